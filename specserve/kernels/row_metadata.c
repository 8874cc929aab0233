/* The attention metadata of a decode-shaped forward (cpu_metadata.py's row-invariant path), in
 * one call instead of ~20 numpy ops: after a step's weights have streamed through the caches each
 * of those costs several times its hot price (0.15-0.3 ms a forward of an EAGLE-3 head's catch-up
 * or a verification on a Zen3, against a ~5 ms step).
 *
 * specs: [batch, 4] int64 rows: table row, prefix length, new tokens, address of the request's
 * [n, n] tree mask (bool, row-major) or 0 (causal). Outputs, allocated by the caller:
 *   kv_indices  [batch, num_keys]: the row's first prefix + n slots, then pad_slot;
 *   query_mask  [batch, max_query, num_keys] bool: key j visible to query q (q clamped to the
 *               request's last real query) iff j <= prefix + q, the tree mask over the new keys;
 *   row_batch, row_query [T] int32: each new token's request and its index within the request;
 *   query_index [batch * max_query], output_index [T] (NULL unless the widths differ): the flat
 *               input row of each padded query (0 for padding), the padded row of each token.
 * Returns 0, or -1 if a row would read past the table's width (the caller's bug). */
#include <stdint.h>
#include <string.h>

int build_row_metadata(const int64_t *table, int64_t table_width, int64_t batch, const int64_t *specs,
                       int64_t pad_slot, int64_t num_keys, int64_t max_query, int64_t *kv_indices,
                       uint8_t *query_mask, int32_t *row_batch, int32_t *row_query, int64_t *query_index,
                       int64_t *output_index) {
    int64_t token = 0;
    for (int64_t b = 0; b < batch; b++) {
        const int64_t *spec = specs + 4 * b;
        int64_t row = spec[0], prefix = spec[1], n = spec[2];
        const uint8_t *tree = (const uint8_t *)(intptr_t)spec[3];
        int64_t length = prefix + n, copied = length < table_width ? length : table_width;
        if (length > num_keys || n < 1 || n > max_query) return -1;
        int64_t *keys = kv_indices + b * num_keys;
        memcpy(keys, table + row * table_width, (size_t)copied * sizeof(int64_t));
        for (int64_t j = copied; j < num_keys; j++) keys[j] = pad_slot;
        for (int64_t q = 0; q < max_query; q++) {
            int64_t real = q < n ? q : n - 1;
            uint8_t *mask = query_mask + (b * max_query + q) * num_keys;
            int64_t visible = prefix + real + 1;
            memset(mask, 1, (size_t)visible);
            memset(mask + visible, 0, (size_t)(num_keys - visible));
            if (tree && q < n) memcpy(mask + prefix, tree + q * n, (size_t)n);
            if (query_index) query_index[b * max_query + q] = q < n ? token + q : 0;
        }
        for (int64_t q = 0; q < n; q++) {
            row_batch[token + q] = (int32_t)b;
            row_query[token + q] = (int32_t)q;
            if (output_index) output_index[token + q] = b * max_query + q;
        }
        token += n;
    }
    return 0;
}
