/* The threads of a decode step's calls (one row of x), included by qdot.c before qdot_moe.h.
 *
 * An OpenMP region ends when every thread of its team has arrived: on a machine whose cores
 * other processes share, a thread woken late (OMP_WAIT_POLICY=PASSIVE sleeps between regions)
 * held each call up by its wake-up, 5-8x the call's own time at a load of 5 on 2 cores. Here
 * the calling thread and the pool's threads take the call's pieces one at a time from a shared
 * ticket, and the caller waits only for pieces some thread has taken: a thread that wakes late
 * finds nothing left and sleeps again. Each piece is computed by one thread with the same
 * kernels, so the bits are those of any other split.
 *
 * The ticket holds the job's generation (high 32 bits) and its next piece (low 32 bits,
 * POOL_CLOSED between jobs); a piece is taken by a compare-exchange on it, so a thread that
 * read an older job's fields cannot take a piece of a newer one. One job at a time: a second
 * caller (another Python thread) computes its call alone. Without OpenMP (a build that has no
 * threads), every call runs on the calling thread. */

typedef void (*piece_fn)(void *ctx, int64_t piece);

#ifdef _OPENMP
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>

#define POOL_MAX 63 /* threads beside the caller */
#define POOL_CLOSED 0xffffffffu

static struct {
    pthread_mutex_t mu, run; /* mu: gen and the wake-up; run: one job at a time */
    pthread_cond_t cv;
    _Atomic uint64_t ticket;
    _Atomic int64_t done, n;
    _Atomic(piece_fn) fn;
    _Atomic(void *) ctx;
    uint32_t gen; /* under mu */
    int started;  /* under run */
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, POOL_CLOSED, 0, 0, 0, 0, 0, 0};

/* take and compute pieces of the current job until none is left */
static void pool_work(void) {
    for (;;) {
        uint64_t t = atomic_load_explicit(&pool.ticket, memory_order_acquire);
        const uint32_t piece = (uint32_t)t;
        if (piece == POOL_CLOSED) return;
        const piece_fn fn = atomic_load_explicit(&pool.fn, memory_order_relaxed);
        void *ctx = atomic_load_explicit(&pool.ctx, memory_order_relaxed);
        if ((int64_t)piece >= atomic_load_explicit(&pool.n, memory_order_relaxed)) return;
        if (!atomic_compare_exchange_weak_explicit(&pool.ticket, &t, t + 1, memory_order_acq_rel,
                                                   memory_order_relaxed))
            continue; /* another thread took it, or the job changed: read again */
        fn(ctx, (int64_t)piece);
        atomic_fetch_add_explicit(&pool.done, 1, memory_order_release);
    }
}

static void *pool_thread(void *arg) {
    (void)arg;
    uint32_t seen = 0;
    for (;;) {
        pthread_mutex_lock(&pool.mu);
        while (pool.gen == seen) pthread_cond_wait(&pool.cv, &pool.mu);
        seen = pool.gen;
        pthread_mutex_unlock(&pool.mu);
        pool_work();
    }
    return 0;
}

/* a child of fork() has none of the pool's threads: it starts its own */
static void pool_after_fork(void) {
    pthread_mutex_init(&pool.mu, 0);
    pthread_mutex_init(&pool.run, 0);
    pthread_cond_init(&pool.cv, 0);
    atomic_store(&pool.ticket, POOL_CLOSED);
    pool.gen = 0;
    pool.started = 0;
}

/* fn(ctx, p) for p < n on the caller and up to threads - 1 pool threads */
static void pool_run(piece_fn fn, void *ctx, int64_t n, int threads) {
    if (threads <= 1 || n <= 1 || n >= (int64_t)POOL_CLOSED || pthread_mutex_trylock(&pool.run)) {
        for (int64_t p = 0; p < n; p++) fn(ctx, p);
        return;
    }
    static int forks_handled;
    if (!forks_handled) forks_handled = !pthread_atfork(0, 0, pool_after_fork);
    const int want = threads - 1 < POOL_MAX ? threads - 1 : POOL_MAX;
    for (; pool.started < want; pool.started++) {
        pthread_t th;
        if (pthread_create(&th, 0, pool_thread, 0)) break;
        pthread_detach(th);
    }
    atomic_store_explicit(&pool.fn, fn, memory_order_relaxed);
    atomic_store_explicit(&pool.ctx, ctx, memory_order_relaxed);
    atomic_store_explicit(&pool.n, n, memory_order_relaxed);
    atomic_store_explicit(&pool.done, 0, memory_order_relaxed);
    pthread_mutex_lock(&pool.mu);
    pool.gen++;
    atomic_store_explicit(&pool.ticket, (uint64_t)pool.gen << 32, memory_order_release);
    pthread_cond_broadcast(&pool.cv);
    pthread_mutex_unlock(&pool.mu);
    pool_work();
    /* the pieces other threads took: wait for them (spinning, then yielding the core) */
    for (int spins = 0; atomic_load_explicit(&pool.done, memory_order_acquire) < n; spins++)
        if (spins > 1000) sched_yield();
    atomic_store_explicit(&pool.ticket, ((uint64_t)pool.gen << 32) | POOL_CLOSED, memory_order_release);
    pthread_mutex_unlock(&pool.run);
}
#else
static void pool_run(piece_fn fn, void *ctx, int64_t n, int threads) {
    (void)threads;
    for (int64_t p = 0; p < n; p++) fn(ctx, p);
}
#endif
