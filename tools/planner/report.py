"""tandem plan --report: one self-contained HTML page (no network: the plots
are inline SVG drawn by matplotlib) with the SLO attainment of every
configuration, the predicted latency CDFs against the SLO lines, and, given
validation runs (tandem bench --json reports of the answer run for real),
measured against predicted percentiles."""

import html
import io

import matplotlib

matplotlib.use("svg")
import matplotlib.pyplot as plt  # noqa: E402

plt.rcParams["svg.fonttype"] = "none"  # text as text: small, searchable


def svg(fig):
    buf = io.StringIO()
    fig.savefig(buf, format="svg", bbox_inches="tight")
    plt.close(fig)
    text = buf.getvalue()
    return text[text.index("<svg"):]  # the inline element, without the XML prologue


def attainment(out):
    """Each SLO's predicted value over its bound, per configuration."""
    configs = out["configs"]
    fig, ax = plt.subplots(figsize=(8, 3.6))
    xs = list(range(len(configs)))
    for k in out["slo"]:
        ys = [(c["predicted"].get(k) or 0) / out["slo"][k] for c in configs]
        ax.plot(xs, ys, marker="o", label=k)
    ax.axhline(1.0, color="black", linewidth=1)
    ax.axhline(1.0 / (1 + out["margin"]), color="grey", linestyle="--", linewidth=1,
               label=f"bound with the {out['margin']:.0%} margin")
    ax.set_xticks(xs, [c["config"] for c in configs], rotation=45, ha="right", fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("predicted / SLO bound")
    ax.set_title("SLO attainment by configuration (below the lines: met)")
    ax.legend(fontsize=8)
    return svg(fig)


def cdfs(out, chosen):
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    for ax, metric in zip(axes, ("ttft", "tpot")):
        for c in chosen:
            q = c["result"]["cdf"].get(f"{metric}_ms") or []
            if q:
                ax.plot(q, [p / 100 for p in range(len(q))], label=c["config"])
        for k, v in out["slo"].items():
            if k.startswith(metric + "_"):
                ax.axvline(v, color="red", linestyle="--", linewidth=1, label=f"SLO {k}")
        ax.set_xlabel(f"{metric.upper()} (ms)")
        ax.set_ylabel("share of requests")
        ax.set_title(f"predicted {metric.upper()} CDF")
        ax.legend(fontsize=7)
    return svg(fig)


def validation(out, runs, answer):
    keys = [(m, s) for m in ("ttft", "tpot") for s in ("p50", "p90", "p99")]
    fig, ax = plt.subplots(figsize=(8, 3.4))
    xs = list(range(len(keys)))
    pred = [answer["result"][f"{m}_ms"][s] or 0 for m, s in keys]
    ax.bar([x - 0.2 for x in xs], pred, width=0.4, label="predicted")
    for i, rep in enumerate(runs):
        meas = [rep[f"{m}_ms"][s] or 0 for m, s in keys]
        ax.scatter([x + 0.2 for x in xs], meas, color="black", marker="_" if i else "x", s=80,
                   label="measured" if i == 0 else None, zorder=3)
    ax.set_xticks(xs, [f"{m}_{s}" for m, s in keys])
    ax.set_ylabel("ms")
    ax.set_yscale("log")
    ax.set_title(f"{answer['config']}: measured ({len(runs)} runs) against predicted")
    ax.legend(fontsize=8)
    return svg(fig)


def write(out, path, runs):
    answer = out["answer"]
    pick = answer or min(out["configs"],
                         key=lambda c: max(c["margin_ratio"].values(), default=1e9))
    near = [c for c in out["configs"] if c["config"] in out.get("neighbours", [])]
    e = html.escape
    rows = "".join(
        f"<tr class='{'ok' if c['meets'] else 'miss'}'><td>{e(c['config'])}</td>"
        f"<td>{c['cost']:g}</td><td>{'yes' if c['meets'] else 'no'}</td>"
        + "".join(f"<td>{(c['predicted'].get(k) or 0):.1f}</td>" for k in out["slo"])
        + f"<td>{c['goodput_fraction']:.1%}</td><td>{e(c['bottleneck'])}</td></tr>"
        for c in out["configs"])
    w = out["workload"]
    if answer:
        head = (f"<p class='answer'>Answer: <b>{e(answer['config'])}</b> (cost "
                f"{answer['cost']:g}), bottleneck {e(answer['bottleneck'])}.</p>")
    else:
        b = out["best"]
        head = (f"<p class='answer miss'>No configuration within {out['max_instances']} "
                f"instances meets the SLOs; the best, <b>{e(b['config'])}</b>, misses "
                + ", ".join(f"{e(k)} by {m['over_pct']:.0f}%" if m["over_pct"] is not None
                            else f"{m['predicted']} failed requests"
                            for k, m in b["misses"].items())
                + ".</p>")
    parts = [
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>",
        "<title>tandem plan</title><style>body{font-family:sans-serif;margin:2em;max-width:1000px}"
        "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:2px 8px;"
        "text-align:right}tr.ok{background:#eaffea}tr.miss{background:#fff0f0}"
        ".answer{font-size:1.2em}figure{margin:1em 0}pre{white-space:pre-wrap}</style>"
        "</head><body>",
        "<h1>tandem plan</h1>",
        f"<p>Workload {e(str(w.get('file', '')))}: {w['requests']} requests at "
        f"{w['rate']:.3g} req/s, mean input {w['input_mean']:.0f} and output "
        f"{w['output_mean']:.0f} tokens. SLOs: "
        + ", ".join(f"{e(k)} {v:g} ms" for k, v in out["slo"].items())
        + f" (margin {out['margin']:.0%}); method {e(out['method'])}.</p>",
        head,
        f"<figure id='attainment'>{attainment(out)}</figure>",
        f"<figure id='cdf'>{cdfs(out, [pick] + near)}</figure>",
    ]
    if runs and answer:
        parts.append(f"<figure id='validation'>{validation(out, runs, answer)}</figure>")
    parts += ["<h2>Every configuration</h2><table><tr><th>config</th><th>cost</th><th>meets</th>"
              + "".join(f"<th>{e(k)} (ms)</th>" for k in out["slo"])
              + "<th>goodput</th><th>bottleneck</th></tr>", rows, "</table>"]
    if answer:
        parts.append(f"<h2>Deploy</h2><pre>{e(out['kustomize'])}</pre>")
    parts.append("</body></html>\n")
    with open(path, "w", encoding="utf-8") as f:
        f.write("".join(parts))
