/* Optional time per op of the native decoder layer (``specserve bench plain --profile``):
   seconds accumulated per op while enabled; one flag test per op when off. Wall clock. */
#ifndef SPECSERVE_KERNELS_PROFILE_H
#define SPECSERVE_KERNELS_PROFILE_H
#include <string.h>
#include <time.h>

enum { PROF_NORM, PROF_QKV, PROF_ROTARY, PROF_ATTENTION, PROF_O, PROF_GATE_UP, PROF_SILU, PROF_DOWN,
       PROF_QUANTIZE, PROF_NUM_OPS };
static int profile_on;
static double profile_seconds[PROF_NUM_OPS];

static inline double profile_clock(void) {
    if (!profile_on) return 0.0;
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + 1e-9 * ts.tv_nsec;
}
/* adds the time since `since` to op; returns now */
static inline double profile_mark(int op, double since) {
    if (!profile_on) return 0.0;
    const double now = profile_clock();
    profile_seconds[op] += now - since;
    return now;
}
/* Enables (1) or disables (0) the clock; copies the seconds so far into out (PROF_NUM_OPS doubles,
   if not NULL) and resets them. Returns PROF_NUM_OPS. */
int layer_profile(int enable, double *out) {
    if (out) memcpy(out, profile_seconds, sizeof profile_seconds);
    memset(profile_seconds, 0, sizeof profile_seconds);
    profile_on = enable;
    return PROF_NUM_OPS;
}
#endif
