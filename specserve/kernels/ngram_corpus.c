/* The NGRAM drafter's read-only corpus in C: the same suffix order and trees as
   speculative/ngram_corpus.py (its module doc describes the design), which stays the reference.
   The order is built by a merge sort (stable, so ties keep position order, as numpy's
   lexsort); a match is two binary searches a window and a trie of at most NC_SAMPLE x
   branch_length nodes. Built by build.py (cpu_kernels.c), called from ngram_corpus_native.py. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define NC_MAX_WINDOW 32
#define NC_SAMPLE 64

typedef struct {
    int32_t *tokens, *order;          /* documents each followed by -1; suffix starts in order */
    long num_tokens, num_suffixes;
    int min_window, max_window, branch_length;
} nc_corpus;

static inline int32_t nc_at(const nc_corpus *c, long i) { return i < c->num_tokens ? c->tokens[i] : -1; }

/* suffixes a and b over their first max_window tokens, -1 past a document's end */
static int nc_less_equal(const nc_corpus *c, int32_t a, int32_t b) {
    for (int k = 0; k < c->max_window; k++) {
        const int32_t x = nc_at(c, (long)a + k), y = nc_at(c, (long)b + k);
        if (x != y) return x < y;
        if (x < 0) break;
    }
    return 1;                         /* equal keys: keep the earlier (a comes from the left run) */
}

static void nc_merge_sort(const nc_corpus *c, int32_t *v, int32_t *tmp, long n) {
    for (long width = 1; width < n; width *= 2) {
        for (long lo = 0; lo < n; lo += 2 * width) {
            long mid = lo + width < n ? lo + width : n, hi = lo + 2 * width < n ? lo + 2 * width : n;
            long i = lo, j = mid, k = lo;
            while (i < mid && j < hi) tmp[k++] = nc_less_equal(c, v[i], v[j]) ? v[i++] : v[j++];
            while (i < mid) tmp[k++] = v[i++];
            while (j < hi) tmp[k++] = v[j++];
        }
        memcpy(v, tmp, sizeof(int32_t) * n);
    }
}

void corpus_free(void *handle) {
    nc_corpus *c = (nc_corpus *)handle;
    if (!c) return;
    free(c->tokens), free(c->order), free(c);
}

/* tokens: the documents each followed by -1 (ids >= 0) */
void *corpus_new(const int32_t *tokens, long n, int min_window, int max_window, int branch_length) {
    nc_corpus *c = (nc_corpus *)calloc(1, sizeof(nc_corpus));
    if (!c) return NULL;
    c->min_window = min_window, c->branch_length = branch_length;
    c->max_window = max_window < NC_MAX_WINDOW ? max_window : NC_MAX_WINDOW;
    c->num_tokens = n;
    c->tokens = (int32_t *)malloc(sizeof(int32_t) * (n > 0 ? n : 1));
    c->order = (int32_t *)malloc(sizeof(int32_t) * (n > 0 ? n : 1));
    int32_t *tmp = (int32_t *)malloc(sizeof(int32_t) * (n > 0 ? n : 1));
    if (!c->tokens || !c->order || !tmp) {
        free(tmp), corpus_free(c);
        return NULL;
    }
    memcpy(c->tokens, tokens, sizeof(int32_t) * n);
    for (long i = 0; i < n; i++)
        if (tokens[i] >= 0) c->order[c->num_suffixes++] = (int32_t)i;
    nc_merge_sort(c, c->order, tmp, c->num_suffixes);
    free(tmp);
    return c;
}

/* the suffix at start against pattern[0..w): -1, 0 or 1 */
static int nc_compare(const nc_corpus *c, int32_t start, const int32_t *pattern, int w) {
    for (int k = 0; k < w; k++) {
        const int32_t t = nc_at(c, (long)start + k);
        if (t != pattern[k]) return t < pattern[k] ? -1 : 1;
    }
    return 0;
}

static long nc_bound(const nc_corpus *c, const int32_t *pattern, int w, int upper) {
    long lo = 0, hi = c->num_suffixes;
    while (lo < hi) {
        const long mid = lo + (hi - lo) / 2;
        const int cmp = nc_compare(c, c->order[mid], pattern, w);
        if (cmp < 0 || (upper && cmp == 0)) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

typedef struct { int32_t token, parent, count, first_child, next_sibling, first_seen, depth; } nc_node;

/* the continuations' trie below node 0 (the root), from up to NC_SAMPLE occurrences of [lo, hi) */
static int nc_trie(const nc_corpus *c, long lo, long hi, int w, int depth, nc_node *nodes) {
    const long count = hi - lo, picks = count <= NC_SAMPLE ? count : NC_SAMPLE;
    int n = 1;
    nodes[0] = (nc_node){-1, -1, 0, -1, -1, -1, 0};
    for (long j = 0; j < picks; j++) {
        const long i = count <= NC_SAMPLE ? lo + j : lo + j * count / NC_SAMPLE;
        const long start = (long)c->order[i] + w;
        int32_t node = 0;
        for (int d = 0; d < depth; d++) {
            const int32_t t = nc_at(c, start + d);
            if (t < 0) break;
            int32_t child = nodes[node].first_child, last = -1;
            while (child >= 0 && nodes[child].token != t) last = child, child = nodes[child].next_sibling;
            if (child < 0) {
                child = n++;
                nodes[child] = (nc_node){t, node, 0, -1, -1, (int32_t)j, d + 1};
                if (last < 0) nodes[node].first_child = child;
                else nodes[last].next_sibling = child;
            }
            nodes[child].count++;
            node = child;
        }
    }
    return n;
}

/* a ranks before b: more counted, then first reached by an earlier occurrence, then shallower */
static inline int nc_before(const nc_node *a, const nc_node *b) {
    if (a->count != b->count) return a->count > b->count;
    if (a->first_seen != b->first_seen) return a->first_seen < b->first_seen;
    return a->depth < b->depth;
}

/* the max_nodes - 1 best-ranked trie nodes, written parents-first (a parent ranks before its
   children) */
static int nc_best(const nc_node *nodes, int n, int32_t root, int max_nodes, int32_t *tokens, int32_t *parents,
                   int32_t *kept, int32_t *index) {
    int k = 0;
    for (int i = 1; i < n; i++) {     /* insertion into the sorted prefix kept[0..k) */
        if (k == max_nodes - 1 && !nc_before(&nodes[i], &nodes[kept[k - 1]])) continue;
        int pos = k < max_nodes - 1 ? k++ : k - 1;
        while (pos > 0 && nc_before(&nodes[i], &nodes[kept[pos - 1]])) kept[pos] = kept[pos - 1], pos--;
        kept[pos] = i;
    }
    tokens[0] = root, parents[0] = -1, index[0] = 0;
    for (int j = 0; j < k; j++) {
        index[kept[j]] = j + 1;
        tokens[j + 1] = nodes[kept[j]].token;
        parents[j + 1] = index[nodes[kept[j]].parent];
    }
    return k + 1;
}

/* the tree for the context's last `len` tokens: node count (1: no match), -1 on bad arguments
   or no memory */
int corpus_match(void *handle, const int32_t *tail, int len, int max_nodes, int32_t *tokens, int32_t *parents) {
    const nc_corpus *c = (const nc_corpus *)handle;
    if (len < 1 || max_nodes < 1) return -1;
    tokens[0] = tail[len - 1], parents[0] = -1;
    if (max_nodes == 1 || c->num_suffixes == 0) return 1;
    const int depth = c->branch_length < max_nodes - 1 ? c->branch_length : max_nodes - 1;
    const int cap = NC_SAMPLE * depth + 1;
    nc_node *nodes = (nc_node *)malloc(sizeof(nc_node) * cap);
    int32_t *kept = (int32_t *)malloc(sizeof(int32_t) * max_nodes), *index = (int32_t *)malloc(sizeof(int32_t) * cap);
    int result = nodes && kept && index ? 1 : -1;
    for (int w = len < c->max_window ? len : c->max_window; result == 1 && w >= c->min_window; w--) {
        const int32_t *pattern = tail + len - w;
        const long lo = nc_bound(c, pattern, w, 0), hi = nc_bound(c, pattern, w, 1);
        if (lo == hi) continue;
        const int n = nc_trie(c, lo, hi, w, depth, nodes);
        if (n > 1) result = nc_best(nodes, n, tail[len - 1], max_nodes, tokens, parents, kept, index);
    }
    free(nodes), free(kept), free(index);
    return result;
}
