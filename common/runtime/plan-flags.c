/* The parallel-plan flags every command that runs the model takes, and
 * --plan-dry-run. */
#include <stdio.h>
#include <string.h>

#include "cli.h"
#include "common/model/model.h"
#include "common/parallel/plan.h"

/* The plan's flags in td_plan_flag's order, then --plan-dry-run. */
#define PLAN_DRY_RUN TD_PLAN_N_FLAGS
const td_opt td_cli_plan_opts[] = {
    [TD_PLAN_FLAG_TP] = {"tp", 0, "N", "tensor-parallel ranks (heads and FFN columns split)"},
    [TD_PLAN_FLAG_PP] = {"pp", 0, "N", "pipeline stages (contiguous layer ranges)"},
    [TD_PLAN_FLAG_PP_LAYERS] = {"pp-layers", 0, "A,B,...",
                                "layers per stage (default: even split)"},
    [TD_PLAN_FLAG_CP] = {"cp", 0, "N",
                         "context-parallel ranks (prompt tokens in prefill, KV\n"
                         "positions in decode; block b on CP rank b mod N)"},
    [TD_PLAN_FLAG_CP_MODE] = {"cp-mode", 0, "MODE",
                              "prefill K/V exchange: allgather (default) or ring"},
    [TD_PLAN_FLAG_CP_MIN_TOKENS] = {"cp-min-tokens", 0, "N",
                                    "prompts shorter than N are not split over CP (default 256)"},
    [TD_PLAN_FLAG_EP] = {"ep", 0, "N",
                         "expert-parallel ranks for MoE models (default: the TP group)"},
    [TD_PLAN_FLAG_ATTN_DP] = {"attn-dp", 0, NULL, "MoE: attention data-parallel over the EP ranks"},
    [PLAN_DRY_RUN] = {"plan-dry-run", 0, NULL,
                      "print the plan (per rank: layers, weight and KV bytes,\n"
                      "bytes sent per step) and exit"},
};
const int td_cli_plan_n_opts = (int)(sizeof td_cli_plan_opts / sizeof td_cli_plan_opts[0]);
_Static_assert(sizeof td_cli_plan_opts / sizeof td_cli_plan_opts[0] == PLAN_DRY_RUN + 1,
               "a table entry for every plan flag");

static bool plan_set(void *ctx, int i, const char *val, bool *printed) {
    td_cli_plan *cp = ctx;
    TD_UNUSED(printed);
    if (i == PLAN_DRY_RUN) {
        cp->dry_run = true;
        return true;
    }
    if (!td_plan_set_flag(&cp->p, (td_plan_flag)i, val)) return false;
    cp->given = true;
    return true;
}

td_optset td_cli_plan_optset(td_cli_plan *cp) {
    return (td_optset){td_cli_plan_opts, td_cli_plan_n_opts, plan_set, cp};
}

void td_cli_plan_usage(FILE *f) { td_opts_print(f, td_cli_plan_opts, td_cli_plan_n_opts); }

int td_cli_plan_check(const char *cmd, const td_cli_plan *cp, const char *model_path) {
    if (!cp->dry_run && !cp->given) return -1;
    td_model_params mp = td_model_default_params();
    mp.path = model_path;
    td_model *m = NULL;
    if (td_model_load(&mp, &m) != TD_OK) return 1;
    td_plan *plan = NULL;
    const td_model_config *cfg = td_model_get_config(m);
    td_status st = td_plan_create(&cp->p, cfg, cfg->n_expert, cfg->n_expert_used, &plan);
    td_model_free(m);
    if (st != TD_OK) {
        fprintf(stderr, "tandem %s: the plan does not fit the model (see above)\n", cmd);
        return 2;
    }
    int rc = -1;
    if (cp->dry_run) rc = td_plan_report(plan, model_path, stdout) == TD_OK ? 0 : 1;
    td_plan_destroy(plan);
    return rc;
}
