/* The parallel-plan flags every command that runs the model takes, and
 * --plan-dry-run. */
#include <stdio.h>
#include <string.h>

#include "cli.h"
#include "common/model/model.h"
#include "common/parallel/plan.h"

int td_cli_plan_flag(td_cli_plan *cp, int argc, char **argv, int *i) {
    const char *opt = argv[*i];
    if (!strcmp(opt, "--plan-dry-run")) {
        cp->dry_run = true;
        return 1;
    }
    const char *val = *i + 1 < argc ? argv[*i + 1] : NULL;
    int n = td_plan_parse_flag(&cp->p, opt, val);
    if (n < 0) return -1;
    if (n == 0) return 0;
    *i += n - 1;
    cp->given = true;
    return 1;
}

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
