/* The NGRAM drafter's n-gram trie in C: the same structure and results as
   speculative/ngram_cache.py (its module doc describes the design), which stays the reference.

   Nodes live in arrays indexed by slot; an open-addressing table maps each n-gram's 61-bit
   polynomial hash (the Python keys, exactly) to its slot. A doubly linked list keeps the
   least-recently-used order (head: oldest), and each node keeps its children in the order
   they were linked (what a Python dict's insertion order gives), so every sort and tie below
   resolves as the Python code's stable sorts and heaps do. Feeding a 200-token prompt costs
   ~30 hash-table updates a token either way; here that is microseconds instead of ~7 ms.
   Built by build.py (cpu_kernels.c), called from speculative/native_ngram.py. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#define NG_MOD ((1ULL << 61) - 1)
#define NG_BASE (0x9E3779B97F4A7C15ULL % NG_MOD)
#define NG_ROOT 0ULL
#define NG_NONE (-1)

typedef struct {
    uint64_t key, parent;         /* hashes of the n-gram and of its prefix (NG_ROOT: a unigram) */
    int64_t count, last_used;
    int32_t token;
    int32_t lru_prev, lru_next;
    int32_t linked_parent;        /* slot whose child list holds this node, or NG_NONE */
    int32_t first_child, last_child, next_sibling, prev_sibling;
} ng_node;

typedef struct {
    long capacity;
    int min_window, max_window, branch_length, min_breadth, max_breadth, max_depth;
    ng_node *nodes;                             /* room for slot_capacity (ng_map) */
    int32_t num_slots, num_used, free_head;    /* free slots chain through lru_next */
    long slot_capacity;
    int32_t lru_head, lru_tail;
    int32_t *table;                             /* slot + 1, 0 = empty */
    uint64_t table_mask;
    int64_t clock;
} ng_trie;

#define NG_HUGE_PAGE (2L << 20)

/* `bytes` of zeroed memory (a multiple of NG_HUGE_PAGE from 2 MiB on, aligned to it) advised for
   transparent huge pages. The trie is read at random: a million nodes span ~70 MB, so in 4 KiB
   pages nearly every access is a TLB miss and, in a VM, a two-level page walk. With 1.1M nodes,
   after 64 MB went through the caches (as a decode step's weights do), feeding one token took
   23-24 us in 4 KiB pages and 11-15 us in huge ones (one core of a Zen3 VM). */
static void *ng_map(size_t bytes) {
    const size_t slop = bytes >= (size_t)NG_HUGE_PAGE ? (size_t)NG_HUGE_PAGE : 0;
    char *p = (char *)mmap(NULL, bytes + slop, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return NULL;
    if (slop) {                                 /* keep the aligned part */
        const size_t head = (size_t)(-(uintptr_t)p & (uintptr_t)(NG_HUGE_PAGE - 1));
        if (head) munmap(p, head);
        if (slop - head) munmap(p + head + bytes, slop - head);
        p += head;
#ifdef MADV_HUGEPAGE
        madvise(p, bytes, MADV_HUGEPAGE);       /* a hint: refused or THP off, 4 KiB pages serve */
#endif
    }
    return p;
}

/* ng_map's size for `bytes` */
static size_t ng_map_size(size_t bytes) {
    return bytes < (size_t)NG_HUGE_PAGE ? bytes : (bytes + NG_HUGE_PAGE - 1) / NG_HUGE_PAGE * NG_HUGE_PAGE;
}

static void ng_unmap(void *p, size_t bytes) {
    if (p) munmap(p, bytes);
}

static inline uint64_t ng_step(uint64_t key, int32_t token) {
    return (uint64_t)(((unsigned __int128)key * NG_BASE + (uint64_t)token + 1) % NG_MOD);
}

static inline uint64_t ng_mix(uint64_t key) { return (key ^ (key >> 29)) * 0xBF58476D1CE4E5B9ULL; }

static int32_t ng_find(const ng_trie *t, uint64_t key) {
    for (uint64_t i = ng_mix(key) & t->table_mask;; i = (i + 1) & t->table_mask) {
        const int32_t s = t->table[i];
        if (s == 0) return NG_NONE;
        if (t->nodes[s - 1].key == key) return s - 1;
    }
}

static void ng_table_put(ng_trie *t, uint64_t key, int32_t slot) {
    uint64_t i = ng_mix(key) & t->table_mask;
    while (t->table[i]) i = (i + 1) & t->table_mask;
    t->table[i] = slot + 1;
}

static void ng_table_remove(ng_trie *t, uint64_t key) {        /* backward-shift deletion */
    uint64_t i = ng_mix(key) & t->table_mask;
    while (t->nodes[t->table[i] - 1].key != key) i = (i + 1) & t->table_mask;
    for (uint64_t j = i;;) {
        t->table[i] = 0;
        for (;;) {
            j = (j + 1) & t->table_mask;
            if (!t->table[j]) return;
            const uint64_t home = ng_mix(t->nodes[t->table[j] - 1].key) & t->table_mask;
            if (((j - home) & t->table_mask) >= ((j - i) & t->table_mask)) break;   /* may move to i */
        }
        t->table[i] = t->table[j];
        i = j;
    }
}

static int ng_grow_table(ng_trie *t) {
    const uint64_t size = (t->table_mask + 1) * 2;
    int32_t *table = (int32_t *)ng_map(ng_map_size(size * sizeof(int32_t))), *old = t->table;
    if (!table) return -1;
    const uint64_t old_size = t->table_mask + 1;
    t->table = table;
    t->table_mask = size - 1;
    for (uint64_t i = 0; i < old_size; i++)
        if (old[i]) ng_table_put(t, t->nodes[old[i] - 1].key, old[i] - 1);
    ng_unmap(old, ng_map_size(old_size * sizeof(int32_t)));
    return 0;
}

static int32_t ng_alloc_slot(ng_trie *t) {
    if (t->free_head != NG_NONE) {
        const int32_t s = t->free_head;
        t->free_head = t->nodes[s].lru_next;
        return s;
    }
    if (t->num_slots == t->slot_capacity) {     /* room doubles (untouched pages cost nothing) */
        const long capacity = t->slot_capacity ? 2 * t->slot_capacity : 4096;
        const size_t bytes = ng_map_size((size_t)capacity * sizeof(ng_node));
        ng_node *nodes = (ng_node *)ng_map(bytes);
        if (!nodes) return NG_NONE;
        if (t->nodes) memcpy(nodes, t->nodes, (size_t)t->num_slots * sizeof(ng_node));
        ng_unmap(t->nodes, ng_map_size((size_t)t->slot_capacity * sizeof(ng_node)));
        t->nodes = nodes;
        t->slot_capacity = (long)(bytes / sizeof(ng_node));
    }
    return t->num_slots++;
}

static void ng_lru_unlink(ng_trie *t, int32_t s) {
    ng_node *n = &t->nodes[s];
    if (n->lru_prev != NG_NONE) t->nodes[n->lru_prev].lru_next = n->lru_next; else t->lru_head = n->lru_next;
    if (n->lru_next != NG_NONE) t->nodes[n->lru_next].lru_prev = n->lru_prev; else t->lru_tail = n->lru_prev;
}

static void ng_lru_append(ng_trie *t, int32_t s) {
    ng_node *n = &t->nodes[s];
    n->lru_prev = t->lru_tail;
    n->lru_next = NG_NONE;
    if (t->lru_tail != NG_NONE) t->nodes[t->lru_tail].lru_next = s; else t->lru_head = s;
    t->lru_tail = s;
}

static inline void ng_touch(ng_trie *t, int32_t s) {           /* OrderedDict.move_to_end */
    if (t->lru_tail == s) return;
    ng_lru_unlink(t, s);
    ng_lru_append(t, s);
}

static void ng_link_child(ng_trie *t, int32_t parent, int32_t s) {
    ng_node *n = &t->nodes[s], *p = &t->nodes[parent];
    n->linked_parent = parent;
    n->next_sibling = NG_NONE;
    n->prev_sibling = p->last_child;
    if (p->last_child != NG_NONE) t->nodes[p->last_child].next_sibling = s; else p->first_child = s;
    p->last_child = s;
}

static void ng_unlink_child(ng_trie *t, int32_t s) {
    ng_node *n = &t->nodes[s], *p = &t->nodes[n->linked_parent];
    if (n->prev_sibling != NG_NONE) t->nodes[n->prev_sibling].next_sibling = n->next_sibling;
    else p->first_child = n->next_sibling;
    if (n->next_sibling != NG_NONE) t->nodes[n->next_sibling].prev_sibling = n->prev_sibling;
    else p->last_child = n->prev_sibling;
    n->linked_parent = NG_NONE;
}

/* one occurrence of the n-gram `key` (ending with `token`, prefix `parent`) */
static int ng_feed_one(ng_trie *t, uint64_t key, uint64_t parent, int32_t token) {
    int32_t s = ng_find(t, key);
    if (s == NG_NONE) {
        if ((uint64_t)(t->num_used + 1) * 2 > t->table_mask + 1 && ng_grow_table(t)) return -1;
        if ((s = ng_alloc_slot(t)) == NG_NONE) return -1;
        ng_node *n = &t->nodes[s];
        n->key = key, n->parent = parent, n->count = 1, n->last_used = t->clock, n->token = token;
        n->linked_parent = n->first_child = n->last_child = n->next_sibling = n->prev_sibling = NG_NONE;
        ng_table_put(t, key, s);
        ng_lru_append(t, s);
        t->num_used++;
    } else {
        t->nodes[s].count++;
        t->nodes[s].last_used = t->clock;
        ng_touch(t, s);
    }
    if (parent != NG_ROOT && t->nodes[s].linked_parent == NG_NONE) {
        const int32_t p = ng_find(t, parent);      /* an evicted parent: the child stays findable by hash */
        if (p != NG_NONE) ng_link_child(t, p, s);
    }
    return 0;
}

static void ng_evict(ng_trie *t) {
    while (t->num_used > t->capacity) {
        const int32_t s = t->lru_head;
        ng_node *n = &t->nodes[s];
        if (n->linked_parent != NG_NONE) ng_unlink_child(t, s);
        for (int32_t c = n->first_child; c != NG_NONE; c = t->nodes[c].next_sibling) t->nodes[c].linked_parent = NG_NONE;
        ng_lru_unlink(t, s);
        ng_table_remove(t, n->key);
        n->lru_next = t->free_head;
        t->free_head = s;
        t->num_used--;
    }
}

/* keys of tokens[end - m : end] for m = min(max_len, end) .. 1, longest first; returns their number */
static int ng_suffix_keys(const int32_t *tokens, int end, int max_len, uint64_t *keys) {
    const int n = end < max_len ? end : max_len;
    uint64_t key = NG_ROOT, power = 1;
    for (int i = 0; i < n; i++) {                 /* keys[n - 1 - i]: the window of the last i + 1 tokens */
        key = (uint64_t)(((unsigned __int128)((uint64_t)tokens[end - 1 - i] + 1) * power + key) % NG_MOD);
        power = (uint64_t)(((unsigned __int128)power * NG_BASE) % NG_MOD);
        keys[n - 1 - i] = key;
    }
    return n;
}

void *ngram_new(long capacity, int min_window, int max_window, int branch_length, int min_breadth,
                int max_breadth) {
    ng_trie *t = (ng_trie *)calloc(1, sizeof(ng_trie));
    if (!t) return NULL;
    t->capacity = capacity, t->min_window = min_window, t->max_window = max_window;
    t->branch_length = branch_length, t->min_breadth = min_breadth, t->max_breadth = max_breadth;
    t->max_depth = max_window + branch_length;
    t->free_head = t->lru_head = t->lru_tail = NG_NONE;
    t->table = (int32_t *)ng_map(ng_map_size(1024 * sizeof(int32_t)));
    t->table_mask = 1023;
    if (!t->table) {
        free(t);
        return NULL;
    }
    return t;
}

void ngram_free(void *handle) {
    ng_trie *t = (ng_trie *)handle;
    if (!t) return;
    ng_unmap(t->nodes, ng_map_size((size_t)t->slot_capacity * sizeof(ng_node)));
    ng_unmap(t->table, ng_map_size((t->table_mask + 1) * sizeof(int32_t)));
    free(t);
}

void ngram_clear(void *handle) {
    ng_trie *t = (ng_trie *)handle;
    ng_unmap(t->nodes, ng_map_size((size_t)t->slot_capacity * sizeof(ng_node)));
    memset(t->table, 0, (t->table_mask + 1) * sizeof(int32_t));
    t->nodes = NULL;
    t->num_slots = t->num_used = 0;
    t->slot_capacity = 0;
    t->free_head = t->lru_head = t->lru_tail = NG_NONE;
}

long ngram_num_nodes(void *handle) { return ((ng_trie *)handle)->num_used; }

long ngram_count(void *handle, const int32_t *ngram, int n) {
    const ng_trie *t = (const ng_trie *)handle;
    if (n <= 0) return 0;
    uint64_t key = NG_ROOT;
    for (int i = 0; i < n; i++) key = ng_step(key, ngram[i]);
    const int32_t s = ng_find(t, key);
    return s != NG_NONE && t->nodes[s].token == ngram[n - 1] ? t->nodes[s].count : 0;
}

/* NgramCache.insert_incremental: the n-grams of tokens[0 : total] that end at one of its last
   num_new tokens (tokens holds at least max_depth - 1 tokens before those, or the sequence's start) */
int ngram_insert(void *handle, const int32_t *tokens, int total, int num_new) {
    ng_trie *t = (ng_trie *)handle;
    if (num_new < 0 || num_new > total) return -1;
    const int start = total - num_new, D = t->max_depth;
    uint64_t *prev = (uint64_t *)malloc(sizeof(uint64_t) * (D + 1)), *keys = (uint64_t *)malloc(sizeof(uint64_t) * (D + 1));
    if (!prev || !keys) {
        free(prev), free(keys);
        return -1;
    }
    t->clock++;
    int num_prev = ng_suffix_keys(tokens, start, D - 1, prev), status = 0;
    for (int pos = start; pos < total && !status; pos++) {
        const int32_t token = tokens[pos];
        for (int i = 0; i < num_prev; i++) keys[i] = ng_step(prev[i], token);
        keys[num_prev] = (uint64_t)token + 1;
        const int num_keys = num_prev + 1;
        for (int i = 0; i < num_keys && !status; i++)
            status = ng_feed_one(t, keys[i], i < num_prev ? prev[i] : NG_ROOT, token);
        const int drop = num_keys < D ? 0 : 1;
        memcpy(prev, keys + drop, sizeof(uint64_t) * (num_keys - drop));
        num_prev = num_keys - drop;
    }
    ng_evict(t);
    free(prev), free(keys);
    return status;
}

/* up to `limit` children of slot s, best first: by (last_used, count) (recency) or (count,
   last_used), ties in link order (a stable sort, as Python's sorted / heapq.nlargest) */
static int ng_children(const ng_trie *t, int32_t s, int limit, int by_count, int32_t *out) {
    int n = 0;
    for (int32_t c = t->nodes[s].first_child; c != NG_NONE; c = t->nodes[c].next_sibling) {
        const ng_node *a = &t->nodes[c];
        const int64_t a1 = by_count ? a->count : a->last_used, a2 = by_count ? a->last_used : a->count;
        int i = n < limit ? n : limit;            /* insertion sort into the best `limit` */
        while (i > 0) {
            const ng_node *b = &t->nodes[out[i - 1]];
            const int64_t b1 = by_count ? b->count : b->last_used, b2 = by_count ? b->last_used : b->count;
            if (b1 > a1 || (b1 == a1 && b2 >= a2)) break;
            if (i < limit) out[i] = out[i - 1];
            i--;
        }
        if (i < limit) out[i] = c;
        if (n < limit) n++;
    }
    return n;
}

static int32_t ng_find_window(ng_trie *t, const int32_t *tail, int len, int *window_len) {
    const int width = len < t->max_window ? len : t->max_window;
    uint64_t *keys = (uint64_t *)malloc(sizeof(uint64_t) * width);
    if (!keys) return NG_NONE;
    const int n = ng_suffix_keys(tail, len, width, keys);
    int32_t found = NG_NONE;
    for (int i = 0; i < n && n - i >= t->min_window; i++) {
        const int32_t s = ng_find(t, keys[i]);
        if (s != NG_NONE && t->nodes[s].token == tail[len - 1] && t->nodes[s].first_child != NG_NONE) {
            ng_touch(t, s);
            *window_len = n - i;
            found = s;
            break;
        }
    }
    free(keys);
    return found;
}

static int ng_bfs(ng_trie *t, int32_t root, int breadth, int max_nodes, int32_t *tokens, int32_t *parents) {
    int32_t *slots = (int32_t *)malloc(sizeof(int32_t) * max_nodes), *depth = (int32_t *)malloc(sizeof(int32_t) * max_nodes);
    int32_t *kids = (int32_t *)malloc(sizeof(int32_t) * (breadth > 0 ? breadth : 1));
    if (!slots || !depth || !kids) {
        free(slots), free(depth), free(kids);
        return -1;
    }
    int n = 1;
    tokens[0] = t->nodes[root].token, parents[0] = -1, slots[0] = root, depth[0] = 0;
    for (int i = 0; i < n && n < max_nodes; i++) {
        if (depth[i] >= t->branch_length) continue;
        const int k = ng_children(t, slots[i], breadth, 0, kids);
        for (int j = 0; j < k && n < max_nodes; j++) {
            tokens[n] = t->nodes[kids[j]].token, parents[n] = i, slots[n] = kids[j], depth[n] = depth[i] + 1;
            ng_touch(t, kids[j]);
            n++;
        }
    }
    free(slots), free(depth), free(kids);
    return n;
}

typedef struct { double neg_score; int64_t tiebreak; int32_t parent, slot, depth; } ng_entry;

static inline int ng_less(const ng_entry *a, const ng_entry *b) {
    return a->neg_score < b->neg_score || (a->neg_score == b->neg_score && a->tiebreak < b->tiebreak);
}

static void ng_heap_push(ng_entry *heap, int *size, ng_entry e) {
    int i = (*size)++;
    while (i > 0 && ng_less(&e, &heap[(i - 1) / 2])) {
        heap[i] = heap[(i - 1) / 2];
        i = (i - 1) / 2;
    }
    heap[i] = e;
}

static ng_entry ng_heap_pop(ng_entry *heap, int *size) {
    const ng_entry top = heap[0], last = heap[--(*size)];
    int i = 0;
    for (;;) {
        int c = 2 * i + 1;
        if (c >= *size) break;
        if (c + 1 < *size && ng_less(&heap[c + 1], &heap[c])) c++;
        if (!ng_less(&heap[c], &last)) break;
        heap[i] = heap[c];
        i = c;
    }
    if (*size > 0) heap[i] = last;
    return top;
}

static int ng_push_children(const ng_trie *t, int32_t s, int node, double score, int depth, int max_nodes,
                            ng_entry *heap, int *size, int64_t *tiebreak, int32_t *kids) {
    if (depth >= t->branch_length) return 0;
    const int k = ng_children(t, s, max_nodes - 1, 1, kids);
    if (k == 0) return 0;
    int64_t total = 0;
    for (int32_t c = t->nodes[s].first_child; c != NG_NONE; c = t->nodes[c].next_sibling) total += t->nodes[c].count;
    for (int j = 0; j < k; j++) {
        const ng_entry e = {(-score * (double)t->nodes[kids[j]].count) / (double)total, ++*tiebreak, node, kids[j], depth + 1};
        ng_heap_push(heap, size, e);
    }
    return k;
}

static int ng_prob(ng_trie *t, int32_t root, int max_nodes, int32_t *tokens, int32_t *parents) {
    /* each popped node pushes at most max_nodes - 1 children: the heap never holds more than this */
    const long cap = (long)max_nodes * (max_nodes > 1 ? max_nodes - 1 : 1) + 1;
    ng_entry *heap = (ng_entry *)malloc(sizeof(ng_entry) * cap);
    int32_t *kids = (int32_t *)malloc(sizeof(int32_t) * (max_nodes > 1 ? max_nodes - 1 : 1));
    if (!heap || !kids) {
        free(heap), free(kids);
        return -1;
    }
    int n = 1, size = 0;
    int64_t tiebreak = 0;
    tokens[0] = t->nodes[root].token, parents[0] = -1;
    ng_push_children(t, root, 0, 1.0, 0, max_nodes, heap, &size, &tiebreak, kids);
    while (size > 0 && n < max_nodes) {
        const ng_entry e = ng_heap_pop(heap, &size);
        tokens[n] = t->nodes[e.slot].token, parents[n] = e.parent;
        ng_touch(t, e.slot);
        n++;
        ng_push_children(t, e.slot, n - 1, -e.neg_score, e.depth, max_nodes, heap, &size, &tiebreak, kids);
    }
    free(heap), free(kids);
    return n;
}

/* NgramCache.match: the draft tree continuing tail (root = its last token) into tokens/parents
   (room for max_nodes); returns its size (1: no match), -1 on bad arguments or no memory */
int ngram_match(void *handle, const int32_t *tail, int len, int max_nodes, int prob, int32_t *tokens, int32_t *parents) {
    ng_trie *t = (ng_trie *)handle;
    if (len < 1 || max_nodes < 1) return -1;
    int window_len = 0;
    const int32_t s = ng_find_window(t, tail, len, &window_len);
    if (s == NG_NONE || max_nodes == 1) {
        tokens[0] = tail[len - 1], parents[0] = -1;
        return 1;
    }
    if (prob) return ng_prob(t, s, max_nodes, tokens, parents);
    const int span = t->max_window - t->min_window;
    const int breadth = span == 0 ? t->max_breadth
        : (int)nearbyint(t->max_breadth - (double)(window_len - t->min_window) / span * (t->max_breadth - t->min_breadth));
    return ng_bfs(t, s, breadth, max_nodes, tokens, parents);
}

/* NgramCache.feed_and_match: ngram_insert(tokens, total, num_new) when num_new > 0, then
   ngram_match of the tokens' last min(total, max_window) (a proposer's step in one call);
   returns ngram_match's result, -1 on bad arguments or no memory */
int ngram_feed_match(void *handle, const int32_t *tokens, int total, int num_new, int max_nodes, int prob,
                     int32_t *out_tokens, int32_t *out_parents) {
    const ng_trie *t = (const ng_trie *)handle;
    if (num_new > 0 && ngram_insert(handle, tokens, total, num_new) != 0) return -1;
    const int len = total < t->max_window ? total : t->max_window;
    return ngram_match(handle, tokens + total - len, len, max_nodes, prob, out_tokens, out_parents);
}
