/* Supervision of the rank processes (exec-impl.h): the driver spawns
 * ranks 1.. with posix_spawn, watches their pidfds from a monitor thread
 * (a rank that exits fails the instance and aborts the world, so no wait
 * hangs), keeps an idle world alive with no-op steps, removes the segments
 * of drivers that died, and reaps the ranks at the end. */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "exec-impl.h"

extern char **environ;

void *td_exec_proc_monitor(void *arg) {
    td_exec *x = arg;
    int n = x->world;
    struct pollfd *fds = calloc((size_t)n, sizeof *fds);
    if (!fds) return NULL;
    fds[0] = (struct pollfd){.fd = x->stop_fd[0], .events = POLLIN};
    for (int r = 1; r < n; r++) fds[r] = (struct pollfd){.fd = x->pidfds[r], .events = POLLIN};
    for (;;) {
        if (poll(fds, (nfds_t)n, -1) < 0) {
            if (errno == EINTR) continue;
            break;
        }
        if (fds[0].revents) break;
        for (int r = 1; r < n; r++) {
            if (!fds[r].revents) continue;
            int status = 0;
            pid_t w = waitpid(x->pids[r], &status, WNOHANG);
            fds[r].fd = -1; /* poll ignores it from now on */
            if (w == x->pids[r]) x->pids[r] = 0;
            /* never x->mu: a step holds it while it waits for this rank */
            if (atomic_load(&x->stopping)) continue;
            if (WIFSIGNALED(status))
                TD_LOG_ERROR("rank %d (pid %d) was killed by signal %d: the instance fails", r,
                             (int)w, WTERMSIG(status));
            else
                TD_LOG_ERROR("rank %d (pid %d) exited with status %d: the instance fails", r,
                             (int)w, WEXITSTATUS(status));
            atomic_store(&x->failed, true);
            atomic_store(&x->cancel, 1); /* rank 0 may still wait for the others to attach */
            if (atomic_load(&x->comm_ready)) td_comm_abort(x->ctl);
        }
    }
    free(fds);
    return NULL;
}

void *td_exec_proc_keepalive(void *arg) {
    td_exec *x = arg;
    const double interval = x->comm_params.timeout_s / 4;
    pthread_mutex_lock(&x->mu);
    while (!atomic_load(&x->stopping)) {
        double now = td_time_s();
        if (now - x->last_use >= interval && !atomic_load(&x->failed)) {
            step_hdr h = {.op = OP_NOOP};
            if (td_exec_step_broadcast_hdr(x, &h)) {
                atomic_store(&x->failed, true);
                td_comm_abort(x->ctl);
            }
            x->last_use = td_time_s();
            continue;
        }
        double wait = x->last_use + interval - now;
        struct timespec ts = td_deadline_after(wait > 0 ? wait : 0.01);
        pthread_cond_timedwait(&x->cv, &x->mu, &ts);
    }
    pthread_mutex_unlock(&x->mu);
    return NULL;
}

/* A driver killed before every rank attached leaves its segment in
 * /dev/shm (it is unlinked only once all have attached): remove those whose
 * driver is gone. Names are /tandem-exec-PID-N. */
void td_exec_proc_remove_stale(double max_wait_s) {
    DIR *d = opendir("/dev/shm");
    if (!d) return;
    struct dirent *de;
    while ((de = readdir(d)) != NULL) {
        int pid = 0, n = 0, end = 0;
        if (sscanf(de->d_name, "tandem-exec-%d-%d%n", &pid, &n, &end) != 2 ||
            de->d_name[end] != '\0' || pid <= 0)
            continue;
        if (kill(pid, 0) == 0 || errno != ESRCH) continue; /* alive, or not ours to judge */
        /* A live driver's segment exists only while its ranks attach (within
         * the attach deadline); an older one is stale even if its pid is in
         * another pid namespace that shares /dev/shm. */
        char name[300], path[320];
        snprintf(name, sizeof name, "/%s", de->d_name);
        snprintf(path, sizeof path, "/dev/shm/%s", de->d_name);
        struct stat sb;
        if (stat(path, &sb) != 0 || time(NULL) - sb.st_mtime < (time_t)(2 * max_wait_s) + 1)
            continue;
        if (shm_unlink(name) == 0) TD_LOG_INFO("removed %s, left by a driver that died", name);
    }
    closedir(d);
}

td_status td_exec_proc_spawn(td_exec *x, const char *exe, const char *name) {
    char self[MAX_PATH];
    if (!exe) {
        ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
        if (n <= 0) {
            TD_LOG_ERROR("cannot find this binary to start the ranks: %s", strerror(errno));
            return TD_ERR_IO;
        }
        self[n] = '\0';
        exe = self;
    }
    char world[16], ppid[16], rank[16], chunk[32], tmo[32];
    snprintf(world, sizeof world, "%d", x->world);
    snprintf(ppid, sizeof ppid, "%d", (int)getpid());
    snprintf(chunk, sizeof chunk, "%zu", x->comm_params.chunk_bytes);
    snprintf(tmo, sizeof tmo, "%.0f", x->comm_params.timeout_s * 1e3);
    /* The ranks start with no blocked signal (the driver may block the ones
     * it takes with sigwait). */
    posix_spawnattr_t attr;
    sigset_t none;
    sigemptyset(&none);
    if (posix_spawnattr_init(&attr) || posix_spawnattr_setsigmask(&attr, &none) ||
        posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETSIGMASK)) {
        TD_LOG_ERROR("posix_spawnattr: out of memory");
        return TD_ERR_NOMEM;
    }
    td_status st = TD_OK;
    for (int r = 1; r < x->world && !st; r++) {
        snprintf(rank, sizeof rank, "%d", r);
        char *argv[] = {(char *)exe, "rank", (char *)name, world, rank, ppid, chunk, tmo, NULL};
        int e = posix_spawn(&x->pids[r], exe, NULL, &attr, argv, environ);
        if (e) {
            x->pids[r] = 0;
            TD_LOG_ERROR("cannot start rank %d (%s): %s", r, exe, strerror(e));
            st = TD_ERR_IO;
            break;
        }
        x->pidfds[r] = (int)syscall(SYS_pidfd_open, x->pids[r], 0);
        if (x->pidfds[r] < 0) {
            TD_LOG_ERROR("pidfd_open for rank %d: %s", r, strerror(errno));
            st = TD_ERR_IO;
        }
    }
    posix_spawnattr_destroy(&attr);
    return st;
}

/* Stops (or kills, after a grace period) and reaps every spawned rank. */
void td_exec_proc_reap(td_exec *x, bool graceful) {
    double t_end = td_time_s() + (graceful ? 10.0 : 0.0);
    for (int r = 1; r < x->world; r++) {
        if (x->pids[r] <= 0) continue;
        for (;;) {
            int status;
            pid_t w = waitpid(x->pids[r], &status, WNOHANG);
            if (w == x->pids[r] || (w < 0 && errno != EINTR)) break;
            if (td_time_s() >= t_end) {
                kill(x->pids[r], SIGKILL);
                waitpid(x->pids[r], &status, 0);
                break;
            }
            struct timespec ts = {0, 5 * 1000000L};
            nanosleep(&ts, NULL);
        }
        x->pids[r] = 0;
    }
}

/* Blocks for the pool: kv_blocks, or kv_memory on the rank with the largest
 * blocks, or kv_seqs sequences of the context limit. */
/* Bytes of one KV block on rank r of plan: its stage's layers, its KV heads. */
void td_exec_proc_stop_monitor(td_exec *x) {
    if (!x->monitor_started) return;
    ssize_t w = write(x->stop_fd[1], "x", 1);
    (void)w;
    pthread_join(x->monitor, NULL);
    x->monitor_started = false;
}
