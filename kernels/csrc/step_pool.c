/* The fused step's parallel loops: its own worker pool (issue 15, sixth round).
 *
 * Every parallel loop of the step is split into chunks that the calling thread and the pool's
 * worker(s) claim one at a time from one atomic counter; the caller takes whatever is left and
 * waits only for chunks a worker has already claimed, never for a worker that has not started.
 * Through the serving stack the other core is often busy (tritonserver, the shim, the response
 * thread wake in bursts as a step's responses go out): an OpenMP region then ends in a barrier
 * that waits for the descheduled worker to get a core, run its static half, and arrive; here the
 * caller runs the chunks itself meanwhile and the worker, once it runs, takes what is still left.
 * Each output element is computed by one chunk with the same instructions whatever thread runs it
 * (rows of a linear, rows of the norms / RoPE / SiLU, attention rows), so results do not depend
 * on the thread count or on who ran which chunk.
 *
 * A worker spins briefly (POOL_SPIN pauses) for the next loop, then sleeps on a futex; the caller
 * wakes sleepers when it publishes a loop (and does not wait for them to wake up). One caller at
 * a time: a second thread calling in while the pool is busy runs its loop alone.
 * step_pool_set(0) selects OpenMP regions instead (the tests); the pool's workers are started
 * on first use, one fewer than the thread count asked for (at most POOL_MAX). */
#define _GNU_SOURCE 1          /* pthread_setname_np (the pool's worker threads) */
#include "decode_cpu.h"

#include <pthread.h>
#include <stdatomic.h>
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <limits.h>
#include <sched.h>
#include <sys/resource.h>

#define POOL_MAX 63
#define POOL_SPIN 4000              /* pause iterations (~0.1 ms) before a worker sleeps */

static struct {
    pthread_mutex_t start_lock;     /* starting workers */
    pthread_mutex_t busy;           /* one caller at a time */
    int workers;                    /* started */
    _Atomic uint64_t state;         /* loop generation << 32 | next unclaimed chunk */
    _Atomic uint32_t seq;           /* futex word: bumped per published loop */
    _Atomic int sleepers;
    _Atomic int64_t done;           /* chunks of the current loop finished */
    _Atomic(chunk_fn) fn;
    _Atomic(void *) ctx;
    _Atomic int64_t n;
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER};

static inline void cpu_pause(void) {
#if defined(__x86_64__)
    __builtin_ia32_pause();
#endif
}

static void *pool_worker(void *arg) {
    (void)arg;
    pthread_setname_np(pthread_self(), "step-pool");    /* for per-thread profiles (/proc/.../comm) */
    /* The process's nice value, not the one inherited from the thread that started the pool (the
     * engine thread may run at a higher priority: the stack's other work should preempt a worker,
     * whose chunks the caller takes over, rather than the caller). Raising it is always allowed. */
    const int self_nice = getpriority(PRIO_PROCESS, (id_t)syscall(SYS_gettid));
    const int proc_nice = getpriority(PRIO_PROCESS, (id_t)getpid());
    if (proc_nice > self_nice) setpriority(PRIO_PROCESS, (id_t)syscall(SYS_gettid), proc_nice);
    uint64_t seen = atomic_load(&pool.state) >> 32;
    for (;;) {
        uint32_t sq = atomic_load(&pool.seq);
        uint64_t s = atomic_load(&pool.state);
        if ((s >> 32) == seen) {
            int spun = 0;
            while (atomic_load_explicit(&pool.seq, memory_order_acquire) == sq && spun < POOL_SPIN) {
                cpu_pause();
                spun++;
            }
            if (atomic_load(&pool.seq) == sq) {
                atomic_fetch_add(&pool.sleepers, 1);
                if (atomic_load(&pool.seq) == sq)
                    syscall(SYS_futex, &pool.seq, FUTEX_WAIT_PRIVATE, sq, NULL, NULL, 0);
                atomic_fetch_sub(&pool.sleepers, 1);
            }
            continue;
        }
        seen = s >> 32;
        for (;;) {          /* claim chunks of loop `seen` until none is left or the loop is over */
            s = atomic_load(&pool.state);
            if ((s >> 32) != seen) break;
            /* Read before the claim: a successful claim of (seen, idx) proves the loop was still
             * current, so these were its fields (the caller moves the state to a closed
             * generation before it writes the next loop's fields). */
            const int64_t n = atomic_load(&pool.n);
            chunk_fn fn = atomic_load(&pool.fn);
            void *ctx = atomic_load(&pool.ctx);
            if ((int64_t)(s & 0xffffffffu) >= n) break;
            if (!atomic_compare_exchange_weak(&pool.state, &s, s + 1)) continue;
            fn(ctx, (int64_t)(s & 0xffffffffu));
            atomic_fetch_add_explicit(&pool.done, 1, memory_order_release);
        }
    }
    return NULL;
}

static int pool_on = 1;

/* 1 (default): the pool runs the parallel loops, 0: OpenMP regions (the tests' invariance
 * checks). Not while a step runs. */
void step_pool_set(int on) { pool_on = on != 0; }

int pool_enabled(void) { return pool_on; }

/* Start workers up to `want`; returns how many run (0 when none could start). */
static int pool_start(int want) {
    if (want > POOL_MAX) want = POOL_MAX;
    if (pool.workers >= want) return pool.workers;      /* only grows; a stale read just locks */
    pthread_mutex_lock(&pool.start_lock);
    while (pool.workers < want) {
        pthread_t t;
        pthread_attr_t a;
        pthread_attr_init(&a);
        pthread_attr_setdetachstate(&a, PTHREAD_CREATE_DETACHED);
        const int rc = pthread_create(&t, &a, pool_worker, NULL);
        pthread_attr_destroy(&a);
        if (rc != 0) break;
        pool.workers++;
    }
    pthread_mutex_unlock(&pool.start_lock);
    return pool.workers;
}

/* fn(ctx, c) for c in [0, n) on up to nt threads (this one included). */
static void pool_run(int nt, int64_t n, chunk_fn fn, void *ctx) {
    if (nt <= 1 || n <= 1 || pool_start(nt - 1) == 0 || pthread_mutex_trylock(&pool.busy) != 0) {
        for (int64_t c = 0; c < n; c++) fn(ctx, c);
        return;
    }
    /* Close the last loop before its fields change: a worker may have read the old state (every
     * chunk claimed) and then this loop's n, and its claim of the old state must then fail, or it
     * would run a chunk of this loop twice and over-count `done`. Generation gen + 1 has no
     * claimable chunk; gen + 2 is this loop. */
    const uint64_t gen = (atomic_load(&pool.state) >> 32) + 1;
    atomic_store(&pool.state, ((gen & 0xffffffffu) << 32) | 0xffffffffu);
    atomic_store(&pool.fn, fn);
    atomic_store(&pool.ctx, ctx);
    atomic_store(&pool.n, n);
    atomic_store(&pool.done, 0);
    atomic_store(&pool.state, ((gen + 1) & 0xffffffffu) << 32);
    atomic_fetch_add(&pool.seq, 1);
    if (atomic_load(&pool.sleepers) > 0)
        syscall(SYS_futex, &pool.seq, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
    int64_t mine = 0;
    for (;;) {
        const int64_t c = (int64_t)(atomic_fetch_add(&pool.state, 1) & 0xffffffffu);
        if (c >= n) break;
        fn(ctx, c);
        mine++;
    }
    atomic_fetch_add(&pool.done, mine);
    /* Only chunks a worker claimed and is running are left: wait for them. */
    for (int spun = 0; atomic_load_explicit(&pool.done, memory_order_acquire) < n; spun++) {
        if (spun < POOL_SPIN) cpu_pause(); else sched_yield();
    }
    pthread_mutex_unlock(&pool.busy);
}

/* A parallel loop of n chunks: the pool, or (step_pool_set(0)) an OpenMP region, static or
 * dynamic schedule, as before the pool. */
void par_for(int nt, int64_t n, chunk_fn fn, void *ctx, int dynamic) {
    if (nt <= 1 || n <= 1) {
        for (int64_t c = 0; c < n; c++) fn(ctx, c);
    } else if (pool_enabled()) {
        pool_run(nt, n, fn, ctx);
    } else if (dynamic) {
#pragma omp parallel for schedule(dynamic) num_threads(nt)
        for (int64_t c = 0; c < n; c++) fn(ctx, c);
    } else {
#pragma omp parallel for schedule(static) num_threads(nt)
        for (int64_t c = 0; c < n; c++) fn(ctx, c);
    }
}
