/* The CPU kernels, compiled together into one library by build.py. */
#include "skinny_linear.c"
#include "paged_attention.c"
#include "decoder_layer.c"
#include "ngram_trie.c"
#include "ngram_corpus.c"
#include "block_unpack.c"
