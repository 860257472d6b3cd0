/* The executor (exec.h, exec-impl.h): its configuration, each rank's
 * shard (model slice, KV pool, engine, the control channel and the data
 * communicators), sizing the pool against memory, create and destroy on
 * the driver, and a rank process's start (td_exec_rank_main). */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/prctl.h>
#include <unistd.h>

#include "exec-impl.h"

td_exec_params td_exec_default_params(void) {
    td_exec_params p;
    memset(&p, 0, sizeof p);
    p.plan = td_plan_default_params();
    p.engine = td_engine_default_params();
    p.block_size = 16;
    p.kv_dtype = TD_TYPE_F32;
    p.isa = td_backend_isa_best();
    p.weight_copy = true;
    p.comm = td_comm_default_params();
    return p;
}

/* ------------------------------------------------------------ the shard */

static void rank_coords(td_exec *x) {
    const td_plan_params *p = &x->cfg.plan;
    x->tp = p->tp;
    x->cp = p->cp;
    x->pp = p->pp;
    x->tp_rank = x->rank % p->tp;
    x->cp_rank = (x->rank / p->tp) % p->cp;
    x->pp_rank = x->rank / (p->tp * p->cp);
}

int td_exec_world_rank_of(const td_exec *x, int tp_rank, int cp_rank, int pp_rank) {
    return (pp_rank * x->cp + cp_rank) * x->tp + tp_rank;
}

/* The data world and its groups (collective over the control world: every
 * rank, same order). */
static td_status split_groups(td_exec *x) {
    const td_plan_params *p = &x->cfg.plan;
    td_status st;
    if ((st = td_comm_split(x->ctl, 0, x->rank, &x->data))) return st;
    /* --attn-dp: attention is whole on every rank, so no TP group (the
     * ranks only meet in the EP group). */
    bool tp_group = p->tp > 1 && !p->attn_dp;
    if (tp_group &&
        (st = td_comm_split(x->data, x->pp_rank * x->cp + x->cp_rank, x->tp_rank, &x->tp_comm)))
        return st;
    if (!tp_group && (st = td_comm_create_single(&x->tp_comm))) return st;
    if (p->cp > 1 &&
        (st = td_comm_split(x->data, x->pp_rank * x->tp + x->tp_rank, x->cp_rank, &x->cp_comm)))
        return st;
    if (p->ep > 1) {
        int in_stage = x->cp_rank * x->tp + x->tp_rank;
        int groups = p->tp * p->cp / p->ep;
        if ((st = td_comm_split(x->data, x->pp_rank * groups + in_stage / p->ep, in_stage % p->ep,
                                &x->ep_comm)))
            return st;
    }
    return TD_OK;
}

/* Loads this rank's shard, KV pool and engine (after the groups exist). */
static td_status load_shard(td_exec *x) {
    const exec_config *c = &x->cfg;
    td_status st;
    if (!td_backend_isa_select((td_isa)c->isa)) {
        TD_LOG_ERROR("rank %d: this CPU cannot run the %s kernels", x->rank,
                     td_backend_isa_name((td_isa)c->isa));
        return TD_ERR_UNSUPPORTED;
    }
    /* process-wide, so set in every rank's process before its engine */
    td_backend_set_act_int8(c->act_int8 != 0);
    td_backend_set_weight_copy(c->weight_copy != 0);
    if ((st = td_threadpool_create(c->n_threads, &x->pool))) return st;
    td_model_params mp = td_model_default_params();
    mp.path = c->model_path;
    mp.tp_rank = c->plan.attn_dp ? 0 : x->tp_rank;
    mp.tp_size = c->plan.attn_dp ? 1 : x->tp;
    if (c->plan.ep > 1) { /* the EP group: consecutive ranks of a stage (td_plan_rank) */
        mp.ep_rank = (x->cp_rank * x->tp + x->tp_rank) % c->plan.ep;
        mp.ep_size = c->plan.ep;
    }
    mp.layer_begin = c->stage_begin[x->pp_rank];
    mp.layer_end = c->stage_begin[x->pp_rank + 1];
    /* a world of one keeps the whole model make_config loaded */
    if (!x->model && (st = td_model_load(&mp, &x->model))) return st;
    const td_model_config *mc = td_model_get_config(x->model);
    x->n_vocab = mc->n_vocab;
    x->n_expert = mc->n_expert;
    x->n_embd = mc->n_embd;
    td_kv_params kp = td_kv_default_params();
    kp.n_layers = mp.layer_end - mp.layer_begin;
    kp.n_kv_heads = td_model_n_head_kv_local(x->model);
    kp.head_dim = mc->head_dim;
    kp.block_size = c->block_size;
    kp.n_blocks = c->n_blocks;
    kp.dtype = (td_dtype)c->kv_dtype;
    if ((st = td_kv_pool_create(&kp, &x->kv))) return st;
    td_engine_params ep = td_engine_default_params();
    ep.max_batch_tokens = c->max_batch_tokens;
    ep.max_seqs = c->max_seqs;
    ep.max_ctx = c->max_ctx;
    ep.cp_comm = x->cp_comm;
    ep.cp_mode = c->plan.cp_mode;
    ep.cp_min_tokens = c->plan.cp_min_tokens;
    ep.ep_comm = x->ep_comm;
    ep.attn_dp = c->plan.attn_dp;
    if ((st = td_engine_create(x->model, x->kv, x->pool, x->tp_comm, &ep, &x->engine))) return st;
    size_t xe = (size_t)c->max_batch_tokens * (size_t)x->n_embd;
    x->x_in = malloc(xe * sizeof(float));
    x->x_out = malloc(xe * sizeof(float));
    x->chunks = malloc((size_t)c->max_seqs * sizeof *x->chunks);
    if (x->n_expert > 0) {
        x->expert_step = calloc((size_t)x->n_expert, sizeof *x->expert_step);
        x->expert_tmp = calloc((size_t)x->n_expert, sizeof *x->expert_tmp);
        x->expert_pub = calloc((size_t)x->n_expert, sizeof *x->expert_pub);
        x->expert_sum = calloc((size_t)x->n_expert, sizeof *x->expert_sum);
    }
    if (!x->x_in || !x->x_out || !x->chunks ||
        (x->n_expert > 0 &&
         (!x->expert_step || !x->expert_tmp || !x->expert_pub || !x->expert_sum))) {
        TD_LOG_ERROR("rank %d: out of memory for step buffers", x->rank);
        return TD_ERR_NOMEM;
    }
    return TD_OK;
}

/* Every rank learns whether every rank is up (collective). */
static td_status agree(td_exec *x, td_status mine) {
    float v = mine != TD_OK ? 1.0f : 0.0f; /* statuses are negative: agree on failed or not */
    td_status st = td_comm_all_reduce(x->ctl, &v, 1, TD_COMM_F32, TD_COMM_MAX, NULL);
    if (st) return st;
    return v > 0 ? TD_ERR_IO : TD_OK;
}

static void release_shard(td_exec *x) {
    td_engine_destroy(x->engine);
    /* after the engine, which gave its KV memory back */
    if (x->ext_state) x->ext->destroy(x->ext_state);
    x->ext_state = NULL;
    td_kv_pool_destroy(x->kv);
    td_model_free(x->model);
    td_threadpool_destroy(x->pool);
    td_comm_destroy(x->ep_comm);
    td_comm_destroy(x->cp_comm);
    td_comm_destroy(x->tp_comm);
    td_comm_destroy(x->data);
    td_comm_destroy(x->ctl);
    free(x->payload);
    free(x->chunks);
    free(x->x_in);
    free(x->x_out);
    free(x->logits);
    free(x->expert_step);
    free(x->expert_tmp);
    free(x->expert_pub);
    free(x->expert_sum);
}

static bool parse_int_arg(const char *s, long lo, long hi, long *out) {
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || end == s || *end || v < lo || v > hi) return false;
    *out = v;
    return true;
}

int td_exec_rank_main(int argc, char **argv, const td_exec_ext_ops *ext) {
    long world, rank, ppid, chunk, timeout_ms;
    if (argc != 7 || !parse_int_arg(argv[2], 2, TD_COMM_MAX_RANKS, &world) ||
        !parse_int_arg(argv[3], 1, world - 1, &rank) ||
        !parse_int_arg(argv[4], 1, INT32_MAX, &ppid) ||
        !parse_int_arg(argv[5], 4096, 1L << 30, &chunk) ||
        !parse_int_arg(argv[6], 1, 1L << 40, &timeout_ms)) {
        fprintf(stderr, "tandem rank: internal command, started by the rank launcher\n");
        return 2;
    }
    /* Die with the driver; it may already be gone. */
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != (pid_t)ppid) return 1;
    /* The driver stops the ranks (OP_STOP) and they die with it
     * (PDEATHSIG): a signal to the whole process group (Ctrl-C, a service
     * manager's SIGTERM) is the driver's to handle, drain included. */
    signal(SIGINT, SIG_IGN);
    signal(SIGTERM, SIG_IGN);
    td_exec *x = calloc(1, sizeof *x);
    if (!x) return 1;
    x->world = (int)world;
    x->rank = (int)rank;
    x->ext = ext;
    td_comm_params cp = td_comm_default_params(); /* the driver's, from argv */
    cp.chunk_bytes = (size_t)chunk;
    cp.timeout_s = (double)timeout_ms / 1e3;
    int rc = 1;
    if (td_comm_shm_create(argv[1], x->world, x->rank, &cp, &x->ctl)) goto done;
    if (td_comm_broadcast(x->ctl, &x->cfg, sizeof x->cfg, 0, NULL)) goto done;
    const td_plan_params *pl = &x->cfg.plan;
    bool ok = x->cfg.magic == CFG_MAGIC && pl->tp >= 1 && pl->cp >= 1 && pl->pp >= 1 &&
              pl->pp <= TD_PLAN_MAX_PP && (long)pl->tp * pl->cp * pl->pp == world && pl->ep >= 1 &&
              (pl->tp * pl->cp) % pl->ep == 0 && x->cfg.max_seqs >= 1 &&
              x->cfg.max_batch_tokens >= 1 && x->cfg.block_size >= 1 && x->cfg.n_blocks >= 1 &&
              td_kv_elem_bytes((uint32_t)x->cfg.kv_dtype) > 0;
    for (int s = 0; ok && s < pl->pp; s++)
        ok = x->cfg.stage_begin[s] >= 0 && x->cfg.stage_begin[s] < x->cfg.stage_begin[s + 1];
    if (!ok) {
        TD_LOG_ERROR("rank %d: bad configuration from the driver", x->rank);
        goto done;
    }
    x->cfg.model_path[MAX_PATH - 1] = '\0';
    rank_coords(x);
    td_status st = split_groups(x);
    if (!st) st = load_shard(x);
    x->reports = NULL;
    if (agree(x, st) || st) goto done;
    rc = td_exec_step_worker_loop(x);
done:
    if (rc && x->ctl) td_comm_abort(x->ctl);
    release_shard(x);
    free(x);
    return rc;
}

static size_t rank_block_bytes(const td_plan *plan, const td_model_config *mc, int r,
                               int32_t block_size, td_dtype kv_dtype) {
    td_rank_coord rc = td_plan_rank(plan, r);
    td_kv_params kp = td_kv_default_params();
    kp.n_layers = rc.layer_end - rc.layer_begin;
    kp.n_kv_heads = td_plan_kv_heads_local(plan);
    kp.head_dim = mc->head_dim;
    kp.block_size = block_size;
    kp.dtype = kv_dtype;
    return td_kv_block_bytes(&kp);
}

static td_status size_pool(const td_exec_params *p, const td_plan *plan, const td_model_config *mc,
                           int32_t *n_blocks) {
    int64_t blocks;
    if (p->kv_blocks > 0) {
        blocks = p->kv_blocks;
    } else if (p->kv_memory > 0) {
        size_t per = 0;
        for (int r = 0; r < td_plan_world(plan); r++)
            per = TD_MAX(per, rank_block_bytes(plan, mc, r, p->block_size, p->kv_dtype));
        blocks = per ? (int64_t)(p->kv_memory / per) : 0;
        if (blocks < 1) {
            TD_LOG_ERROR("--kv-memory %zu bytes holds no KV block (%zu bytes each)", p->kv_memory,
                         per);
            return TD_ERR_INVALID;
        }
    } else {
        int32_t ctx = p->engine.max_ctx > 0 ? p->engine.max_ctx : TD_MIN(mc->n_ctx_train, 4096);
        blocks = ((int64_t)ctx + p->block_size - 1) / p->block_size * TD_MAX(p->kv_seqs, 1);
    }
    if (blocks < 1 || blocks > INT32_MAX) {
        TD_LOG_ERROR("KV pool of %lld blocks is out of range", (long long)blocks);
        return TD_ERR_RANGE;
    }
    *n_blocks = (int32_t)blocks;
    return TD_OK;
}

/* Start-up check of the plan's memory against the host's: the weights once
 * (every rank maps the same file and its shard is a part of it; the CPU
 * backend's private copies of the shards add up to the weights once, the
 * file's page cache then being reclaimable), and per rank
 * its KV pool and its engine scratch (activations of max_batch_tokens rows,
 * attention scratch, step buffers). */
static td_status check_memory(const exec_config *c, const td_plan *plan, const td_model_config *mc,
                              size_t weight_bytes) {
    double total = (double)weight_bytes;
    double rows = c->max_batch_tokens;
    double per_row = 4.0 * (8.0 * mc->n_embd + 2.0 * mc->n_ff + 3.0 * mc->n_head * mc->head_dim);
    for (int r = 0; r < td_plan_world(plan); r++)
        total += (double)rank_block_bytes(plan, mc, r, c->block_size, (td_dtype)c->kv_dtype) *
                     c->n_blocks +
                 rows * per_row;
    uint64_t avail = td_mem_available();
    if (avail > 0 && total > (double)avail) {
        TD_LOG_ERROR("plan: %d ranks need about %.2f GiB (weights %.2f GiB once, KV pool of %d "
                     "blocks and scratch per rank), the host has %.2f GiB available: lower "
                     "--kv-memory / --kv-blocks or the batch, or use fewer ranks",
                     td_plan_world(plan), total / 1073741824.0, weight_bytes / 1073741824.0,
                     c->n_blocks, (double)avail / 1073741824.0);
        return TD_ERR_NOMEM;
    }
    return TD_OK;
}

/* Loads the whole model for its configuration, validates the plan and
 * fills x->cfg and x->world; a world of one keeps the model in x->model. */
static td_status make_config(const td_exec_params *p, td_exec *x) {
    exec_config *c = &x->cfg;
    if (p->comm.chunk_bytes < 4096 || p->comm.chunk_bytes > ((size_t)1 << 30) ||
        !(p->comm.timeout_s >= 0.001) || p->comm.timeout_s > 1e9) {
        TD_LOG_ERROR("executor: comm chunk %zu bytes (4 KiB .. 1 GiB) or timeout %g s out of range",
                     p->comm.chunk_bytes, p->comm.timeout_s);
        return TD_ERR_INVALID;
    }
    if (!p->model_path || strlen(p->model_path) >= MAX_PATH || p->block_size < 1) {
        TD_LOG_ERROR("executor: model path (at most %d bytes) and block size are required",
                     MAX_PATH - 1);
        return TD_ERR_INVALID;
    }
    if (!td_kv_elem_bytes((uint32_t)p->kv_dtype)) {
        TD_LOG_ERROR("executor: a KV cache holds f32, f16 or bf16, not %s",
                     td_dtype_name(p->kv_dtype));
        return TD_ERR_INVALID;
    }
    td_model_params mp = td_model_default_params();
    mp.path = p->model_path;
    td_model *whole = NULL;
    td_status st = td_model_load(&mp, &whole);
    if (st) return st;
    const td_model_config *mc = td_model_get_config(whole);
    td_plan *plan = NULL;
    st = td_plan_create(&p->plan, mc, mc->n_expert, mc->n_expert_used, &plan);
    if (!st) {
        memset(c, 0, sizeof *c);
        c->magic = CFG_MAGIC;
        snprintf(c->model_path, sizeof c->model_path, "%s", p->model_path);
        c->plan = *td_plan_params_get(plan);
        for (int s = 0; s < c->plan.pp; s++) {
            /* the first rank of each stage carries its layer range */
            td_rank_coord rc = td_plan_rank(plan, s * c->plan.tp * c->plan.cp);
            c->stage_begin[s] = rc.layer_begin;
            c->stage_begin[s + 1] = rc.layer_end;
        }
        c->max_batch_tokens = p->engine.max_batch_tokens;
        c->max_seqs = p->engine.max_seqs;
        c->max_ctx = p->engine.max_ctx > 0 ? p->engine.max_ctx : TD_MIN(mc->n_ctx_train, 4096);
        c->block_size = p->block_size;
        c->kv_dtype = (int32_t)p->kv_dtype;
        st = size_pool(p, plan, mc, &c->n_blocks);
        if (!st) st = check_memory(c, plan, mc, td_model_weight_bytes(whole));
        int world = td_plan_world(plan);
        long cores = sysconf(_SC_NPROCESSORS_ONLN);
        c->n_threads =
            p->n_threads > 0 ? p->n_threads : (int)TD_MAX(1, (cores > 0 ? cores : 1) / world);
        c->isa = (int32_t)p->isa;
        c->act_int8 = p->act_int8;
        c->weight_copy = p->weight_copy;
        c->weight_bytes = td_model_weight_bytes(whole);
        x->world = world;
    }
    td_plan_destroy(plan);
    if (!st && x->world == 1)
        x->model = whole;
    else
        td_model_free(whole);
    return st;
}

/* Stops the monitor thread (idempotent): after this only the caller
 * waits for the rank processes. */
static void exec_free(td_exec *x) {
    td_exec_proc_stop_monitor(x);
    for (int r = 1; x->pidfds && r < x->world; r++)
        if (x->pidfds[r] >= 0) close(x->pidfds[r]);
    if (x->stop_fd[0] >= 0) close(x->stop_fd[0]);
    if (x->stop_fd[1] >= 0) close(x->stop_fd[1]);
    if (!x->wrapped) release_shard(x);
    pthread_mutex_destroy(&x->mu);
    pthread_cond_destroy(&x->cv);
    pthread_mutex_destroy(&x->times_mu);
    pthread_mutex_destroy(&x->ext_mu);
    free(x->pending);
    free(x->pids);
    free(x->pidfds);
    free(x->times);
    free(x->reports);
    free(x);
}

static td_exec *exec_alloc(int world) {
    td_exec *x = calloc(1, sizeof *x);
    if (!x) return NULL;
    x->world = world;
    x->stop_fd[0] = x->stop_fd[1] = -1;
    pthread_mutex_init(&x->mu, NULL);
    td_cond_init_monotonic(&x->cv);
    pthread_mutex_init(&x->times_mu, NULL);
    pthread_mutex_init(&x->ext_mu, NULL);
    x->pids = calloc((size_t)world, sizeof *x->pids);
    x->pidfds = malloc((size_t)world * sizeof *x->pidfds);
    x->times = calloc((size_t)world, sizeof *x->times);
    x->reports = calloc((size_t)world, sizeof *x->reports);
    if (!x->pids || !x->pidfds || !x->times || !x->reports) {
        exec_free(x);
        return NULL;
    }
    for (int r = 0; r < world; r++) x->pidfds[r] = -1;
    return x;
}

td_status td_exec_create(const td_exec_params *p, td_exec **x_p) {
    if (!p || !x_p) return TD_ERR_INVALID;
    td_exec probe;
    memset(&probe, 0, sizeof probe);
    td_status st = make_config(p, &probe);
    if (st) return st;
    td_exec *x = exec_alloc(probe.world);
    if (!x) {
        td_model_free(probe.model);
        TD_LOG_ERROR("out of memory");
        return TD_ERR_NOMEM;
    }
    x->cfg = probe.cfg;
    x->comm_params = p->comm;
    x->model = probe.model;
    x->rank = 0;
    rank_coords(x);
    if (x->world == 1) {
        if ((st = td_comm_create_single(&x->ctl)) || (st = split_groups(x)) || (st = load_shard(x)))
            goto fail;
        *x_p = x;
        return TD_OK;
    }
    if (x->world > TD_COMM_MAX_RANKS) {
        TD_LOG_ERROR("a plan of %d ranks: the shared-memory world holds at most %d", x->world,
                     TD_COMM_MAX_RANKS);
        st = TD_ERR_UNSUPPORTED;
        goto fail;
    }
    if (pipe2(x->stop_fd, O_CLOEXEC)) {
        TD_LOG_ERROR("pipe: %s", strerror(errno));
        st = TD_ERR_IO;
        goto fail;
    }
    td_exec_proc_remove_stale(x->comm_params.timeout_s);
    char name[64];
    static atomic_int n_created;
    snprintf(name, sizeof name, "/tandem-exec-%d-%d", (int)getpid(),
             atomic_fetch_add(&n_created, 1));
    if ((st = td_exec_proc_spawn(x, p->exe, name))) goto fail;
    if (pthread_create(&x->monitor, NULL, td_exec_proc_monitor, x)) {
        TD_LOG_ERROR("cannot start the rank monitor");
        st = TD_ERR_NOMEM;
        goto fail;
    }
    x->monitor_started = true;
    td_comm_params cp = x->comm_params; /* the ranks get it through argv */
    cp.cancel = &x->cancel;
    if ((st = td_comm_shm_create(name, x->world, 0, &cp, &x->ctl))) goto fail;
    atomic_store(&x->comm_ready, true);
    if ((st = td_comm_broadcast(x->ctl, &x->cfg, sizeof x->cfg, 0, NULL))) goto fail;
    td_status mine = split_groups(x);
    if (!mine) mine = load_shard(x);
    if ((st = agree(x, mine))) {
        if (!mine) TD_LOG_ERROR("a rank failed to start (see its lines above)");
        goto fail;
    }
    x->last_use = td_time_s();
    if (pthread_create(&x->keepalive, NULL, td_exec_proc_keepalive, x)) {
        TD_LOG_ERROR("cannot start the keep-alive thread");
        st = TD_ERR_NOMEM;
        goto fail;
    }
    x->keepalive_started = true;
    TD_LOG_INFO("plan: %d ranks (tp %d, cp %d, pp %d), %d threads each", x->world, x->tp, x->cp,
                x->pp, x->cfg.n_threads);
    *x_p = x;
    return TD_OK;
fail:
    pthread_mutex_lock(&x->mu);
    atomic_store(&x->stopping, true);
    pthread_mutex_unlock(&x->mu);
    if (x->ctl) td_comm_abort(x->ctl);
    td_exec_proc_stop_monitor(x);
    td_exec_proc_reap(x, false);
    exec_free(x);
    return st;
}

td_status td_exec_wrap(td_engine *e, td_kv_pool *kv, const td_model *m, td_exec **x_p) {
    if (!e || !kv || !m || !x_p) return TD_ERR_INVALID;
    td_exec *x = exec_alloc(1);
    if (!x) return TD_ERR_NOMEM;
    x->wrapped = true;
    x->engine = e;
    x->kv = kv;
    x->model = (td_model *)m;
    x->tp = x->cp = x->pp = 1;
    x->cfg.weight_bytes = td_model_weight_bytes(m);
    *x_p = x;
    return TD_OK;
}

void td_exec_destroy(td_exec *x) {
    if (!x) return;
    if (x->world > 1) {
        pthread_mutex_lock(&x->mu);
        atomic_store(&x->stopping, true);
        bool ok = !atomic_load(&x->failed);
        if (ok) {
            step_hdr h = {.op = OP_STOP};
            ok = td_exec_step_broadcast_hdr(x, &h) == TD_OK;
        }
        pthread_cond_broadcast(&x->cv);
        pthread_mutex_unlock(&x->mu);
        if (x->keepalive_started) pthread_join(x->keepalive, NULL);
        if (!ok) td_comm_abort(x->ctl);
        td_exec_proc_stop_monitor(x);
        td_exec_proc_reap(x, ok);
    }
    exec_free(x);
}

int td_exec_world(const td_exec *x) { return x->world; }
const td_model *td_exec_model(const td_exec *x) { return x->model; }
td_kv_pool *td_exec_kv(td_exec *x) { return x->kv; }
td_engine *td_exec_engine(td_exec *x) { return x->engine; }
int td_exec_threads_per_rank(const td_exec *x) { return x->pool ? td_threadpool_size(x->pool) : 1; }
int32_t td_exec_max_ctx(const td_exec *x) { return x->cfg.max_ctx; }
size_t td_exec_weight_bytes(const td_exec *x) { return (size_t)x->cfg.weight_bytes; }
bool td_exec_failed(const td_exec *x) { return atomic_load(&x->failed); }

int td_exec_expert_load(const td_exec *x, int64_t *counts, int cap) {
    if (x->world == 1) {
        const td_model_config *mc = td_model_get_config(x->model);
        if (mc->n_expert == 0 || cap < mc->n_expert) return 0;
        return td_engine_expert_load(x->engine, -1, counts) == TD_OK ? mc->n_expert : 0;
    }
    pthread_mutex_lock((pthread_mutex_t *)&x->times_mu);
    int n = x->have_expert_load ? TD_MIN(x->n_expert, cap) : 0;
    for (int i = 0; i < n; i++) counts[i] = x->expert_pub[i];
    pthread_mutex_unlock((pthread_mutex_t *)&x->times_mu);
    return n;
}

int td_exec_last_times(const td_exec *x, td_rank_time *out, int cap) {
    pthread_mutex_lock((pthread_mutex_t *)&x->times_mu);
    for (int r = 0; r < TD_MIN(cap, x->world); r++) out[r] = x->times[r];
    pthread_mutex_unlock((pthread_mutex_t *)&x->times_mu);
    return x->world;
}

/* Appends the step's tags and the queued words (taken) to a payload whose
 * header counts them. Driver, under x->mu. */
