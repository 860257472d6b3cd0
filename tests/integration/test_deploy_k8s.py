"""deploy/k8s: every kustomize directory renders with `kubectl kustomize`, every
built-in object validates offline against the Kubernetes schemas
(kubernetes-validate, strict), the CRD objects (KEDA ScaledObject, Prometheus
Operator ServiceMonitor) carry the fields the project relies on, the objects
agree with each other (selectors, ports, probes, drain times, DNS names,
NetworkPolicy), and the real binaries accept the arguments the manifests give
them.

Needs kubectl (kustomize v5) on PATH, else the module is skipped; the PyPI
package kubernetes-validate; TANDEM_BUILD_DIR for the binaries' checks."""

import os
import pathlib
import re
import shutil
import subprocess

import k8s_util
import promql_sum
import pytest
import yaml

HERE = pathlib.Path(__file__).resolve().parent
K8S = pathlib.Path(os.environ.get("TANDEM_SOURCE_DIR") or HERE.parent.parent).resolve() / "deploy" / "k8s"

# The Kubernetes version the built-in objects are validated against (the oldest
# the manifests support: the preStop `sleep` action is on by default from 1.30).
KUBE_VERSION = "1.32.0"

DIRS = ["base", "overlays/cpu-demo", "overlays/gpu", "overlays/autoscale", "overlays/autoscale-hpa"]
CRD_KINDS = {("keda.sh/v1alpha1", "ScaledObject"), ("monitoring.coreos.com/v1", "ServiceMonitor")}
ROLES = ("router", "prefill", "decode")

pytestmark = pytest.mark.skipif(shutil.which("kubectl") is None,
                                reason="kubectl (with kustomize v5) is not on PATH")


@pytest.fixture(scope="module")
def renders():
    return {d: k8s_util.render(K8S / d) for d in DIRS}


def _validator():
    try:
        import jsonschema
        import kubernetes_validate
    except ImportError:
        pytest.fail("the PyPI package kubernetes-validate is not installed (pip install kubernetes-validate)")
    return kubernetes_validate, jsonschema


def _of(objs, kind):
    return [o for o in objs if o["kind"] == kind]


def _one(objs, kind, name):
    found = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name}, found {len(found)}"
    return found[0]


def _role(o):
    return o["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]


def _deploy(objs, role):
    found = [d for d in _of(objs, "Deployment") if _role(d) == role]
    assert len(found) == 1, f"expected one {role} Deployment"
    return found[0]


def _labels_match(sel, labels):
    """A LabelSelector (matchLabels + matchExpressions) against a label map."""
    for k, v in (sel.get("matchLabels") or {}).items():
        if labels.get(k) != v:
            return False
    for e in sel.get("matchExpressions") or []:
        op, k, vals = e["operator"], e["key"], e.get("values") or []
        if op == "In" and labels.get(k) not in vals:
            return False
        if op == "NotIn" and labels.get(k) in vals:
            return False
        if op == "Exists" and k not in labels:
            return False
        if op == "DoesNotExist" and k in labels:
            return False
    return True


def _env_values(objs, container):
    """The container's environment as Kubernetes expands it into args: values,
    ConfigMap keys (looked up in the render), placeholders for Secrets and the
    downward API."""
    cms = {c["metadata"]["name"]: c.get("data") or {} for c in _of(objs, "ConfigMap")}
    env = {}
    for e in container.get("env") or []:
        if "value" in e:
            env[e["name"]] = e["value"]
            continue
        vf = e["valueFrom"]
        if "configMapKeyRef" in vf:
            ref = vf["configMapKeyRef"]
            if ref["name"] in cms:
                assert ref["key"] in cms[ref["name"]], f"ConfigMap {ref['name']} has no key {ref['key']}"
                env[e["name"]] = cms[ref["name"]][ref["key"]]
            else:
                env[e["name"]] = None  # provided by the cluster, not this render
        elif "secretKeyRef" in vf:
            env[e["name"]] = "secret-value"
        elif "fieldRef" in vf:
            env[e["name"]] = {"status.podIP": "10.0.0.7", "metadata.name": "pod-0"}.get(
                vf["fieldRef"]["fieldPath"], "field")
        else:
            env[e["name"]] = "resource"
    return env


def _expanded_args(objs, container):
    env = _env_values(objs, container)
    out = []
    for a in container.get("args") or []:
        for var in re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", a):
            # An undefined $(VAR) would reach the binary literally.
            assert var in env, f"{container['name']}: $({var}) in args is not in env"
            assert env[var] is not None, f"{container['name']}: $({var}) has no value in this render"
        out.append(re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: str(env[m.group(1)]), a))
    return out


def _flag_value(args, flag):
    vals = [args[i + 1] for i, a in enumerate(args[:-1]) if a == flag]
    return vals


# ---------------------------------------------------------------------------
# Rendering and schemas


@pytest.mark.parametrize("d", DIRS)
def test_renders_and_validates(renders, d):
    kv, jsonschema = _validator()
    kinds = set()
    errors = []
    for o in renders[d]:
        kinds.add(o["kind"])
        if (o["apiVersion"], o["kind"]) in CRD_KINDS:
            continue
        try:
            kv.validate(o, KUBE_VERSION, strict=True)
        except jsonschema.ValidationError as e:  # kubernetes_validate's errors derive from it
            errors.append(f"{o['kind']} {o['metadata']['name']}: {e.message} at {list(e.path)}")
    assert not errors, f"{d}: invalid for Kubernetes {KUBE_VERSION} (strict):\n" + "\n".join(errors)
    for k in ("Deployment", "Service", "ConfigMap", "PodDisruptionBudget", "NetworkPolicy", "ServiceMonitor"):
        assert k in kinds, f"{d}: no {k}"
    assert {_role(x) for x in _of(renders[d], "Deployment")} == set(ROLES)


def test_validator_rejects_a_broken_object(renders):
    """The validator in strict mode does catch the mistakes it is used for."""
    kv, jsonschema = _validator()
    dep = _deploy(renders["base"], "router")
    bad = yaml.safe_load(yaml.safe_dump(dep))
    bad["spec"]["template"]["spec"]["containers"][0]["args"].append(8000)  # not a string
    with pytest.raises(jsonschema.ValidationError):
        kv.validate(bad, KUBE_VERSION, strict=True)
    bad = yaml.safe_load(yaml.safe_dump(dep))
    bad["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGett"] = {"port": 1}
    with pytest.raises(jsonschema.ValidationError):
        kv.validate(bad, KUBE_VERSION, strict=True)


# ---------------------------------------------------------------------------
# Cross-object checks


@pytest.mark.parametrize("d", DIRS)
def test_services_select_deployments_and_ports_exist(renders, d):
    objs = renders[d]
    for svc in _of(objs, "Service"):
        sel = svc["spec"]["selector"]
        targets = [x for x in _of(objs, "Deployment")
                   if _labels_match({"matchLabels": sel}, x["spec"]["template"]["metadata"]["labels"])]
        assert len(targets) == 1, f"{d}: Service {svc['metadata']['name']} selects {len(targets)} Deployments"
        dep = targets[0]
        assert _labels_match(dep["spec"]["selector"], dep["spec"]["template"]["metadata"]["labels"])
        cports = {p["name"]: p["containerPort"] for c in dep["spec"]["template"]["spec"]["containers"]
                  for p in c.get("ports") or []}
        for p in svc["spec"]["ports"]:
            assert p["targetPort"] in cports or p["targetPort"] in cports.values(), \
                f"{d}: Service {svc['metadata']['name']} port {p['name']} targets no container port"
            assert p.get("appProtocol"), f"{d}: Service {svc['metadata']['name']} port {p['name']} has no appProtocol"
    router = _one(objs, "Service", "tandem-router")
    protos = {p["name"]: (p["port"], p["appProtocol"]) for p in router["spec"]["ports"]}
    assert protos["http"] == (8000, "http")
    assert protos["grpc"][1] in ("grpc", "kubernetes.io/h2c")
    for role in ("prefill", "decode"):
        assert _one(objs, "Service", f"tandem-{role}")["spec"].get("clusterIP") == "None", f"{role} not headless"
    for pdb in _of(objs, "PodDisruptionBudget"):
        n = [x for x in _of(objs, "Deployment")
             if _labels_match(pdb["spec"]["selector"], x["spec"]["template"]["metadata"]["labels"])]
        assert len(n) == 1, f"{d}: PDB {pdb['metadata']['name']} selects {len(n)} Deployments"
    assert {_role(x) for x in _of(objs, "Deployment")} == {
        pdb["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"]
        for pdb in _of(objs, "PodDisruptionBudget")}


@pytest.mark.parametrize("d", DIRS)
def test_pods_probes_security_and_drain(renders, d):
    objs = renders[d]
    for dep in _of(objs, "Deployment"):
        name = dep["metadata"]["name"]
        pod = dep["spec"]["template"]["spec"]
        psc = pod.get("securityContext") or {}
        vols = {v["name"]: v for v in pod.get("volumes") or []}
        assert len(vols) == len(pod.get("volumes") or []), f"{name}: duplicate volume names"
        for c in pod["containers"]:
            ports = {p["name"]: p["containerPort"] for p in c.get("ports") or []}
            assert "http" in ports, f"{name}: no http port"
            for kind, path in (("startupProbe", "/health"), ("livenessProbe", "/health"), ("readinessProbe", "/ready")):
                pr = c.get(kind)
                assert pr and "httpGet" in pr, f"{name}: no HTTP {kind}"
                assert pr["httpGet"]["path"] == path, f"{name}: {kind} path {pr['httpGet']['path']}"
                port = pr["httpGet"]["port"]
                assert port in ports or port in ports.values(), f"{name}: {kind} port {port} is not a container port"
                assert ports.get(port, port) == ports["http"], f"{name}: {kind} is not on the http port"
            sc = c.get("securityContext") or {}
            assert sc.get("runAsNonRoot", psc.get("runAsNonRoot")) is True, f"{name}: may run as root"
            uid = sc.get("runAsUser", psc.get("runAsUser"))
            assert isinstance(uid, int) and uid > 0, f"{name}: runAsUser {uid!r} is not a numeric non-root uid"
            assert sc.get("readOnlyRootFilesystem") is True, f"{name}: root filesystem is writable"
            assert sc.get("allowPrivilegeEscalation") is False, f"{name}: privilege escalation allowed"
            caps = sc.get("capabilities") or {}
            assert caps.get("drop") == ["ALL"], f"{name}: capabilities not all dropped"
            assert set(caps.get("add") or []) <= {"IPC_LOCK"}, f"{name}: adds {caps.get('add')}"
            res = c.get("resources") or {}
            for k in ("cpu", "memory"):
                assert k in (res.get("requests") or {}) and k in (res.get("limits") or {}), f"{name}: no {k} request/limit"
            mounts = {m["mountPath"]: m for m in c.get("volumeMounts") or []}
            assert "/tmp" in mounts and "emptyDir" in vols[mounts["/tmp"]["name"]], f"{name}: /tmp is not an emptyDir"
            assert mounts.get("/models", {}).get("readOnly") is True, f"{name}: /models not mounted read-only"
            # Drain: the grace period outlasts the preStop sleep plus the drain.
            args = _expanded_args(objs, c)
            drain = _flag_value(args, "--drain-timeout")
            assert len(drain) == 1, f"{name}: --drain-timeout given {len(drain)} times"
            pre = (c.get("lifecycle") or {}).get("preStop") or {}
            if "sleep" in pre:
                sleep_s = int(pre["sleep"]["seconds"])
            else:
                cmd = pre.get("exec", {}).get("command") or []
                assert cmd and cmd[-2].endswith("sleep"), f"{name}: preStop is not a sleep"
                sleep_s = int(cmd[-1])
            assert sleep_s >= 1, f"{name}: no preStop delay"
            grace = pod.get("terminationGracePeriodSeconds", 30)
            assert grace > sleep_s + float(drain[0]), \
                f"{name}: terminationGracePeriodSeconds {grace} <= preStop {sleep_s} + drain {drain[0]}"
            # The cluster token comes from a Secret mounted as a file.
            tf = _flag_value(args, "--cluster-token-file")
            assert len(tf) == 1 and "--cluster-token" not in args, f"{name}: cluster token not read from a file"
            tdir = str(pathlib.PurePosixPath(tf[0]).parent)
            assert tdir in mounts and "secret" in vols[mounts[tdir]["name"]], f"{name}: token file is not a Secret"
            # The process listens on the ports the container declares.
            assert _flag_value(args, "--port") == [str(ports["http"])], f"{name}: --port is not the http port"
            want_grpc = [str(ports["grpc"])] if "grpc" in ports else ["-1"]
            assert _flag_value(args, "--grpc-port") == want_grpc, f"{name}: --grpc-port is not {want_grpc}"
            model = _flag_value(args, "--model")
            assert len(model) == 1 and model[0].startswith("/models/"), f"{name}: model not from /models"


def test_overlay_specifics(renders):
    for d in ("overlays/cpu-demo", "overlays/gpu"):
        for dep in _of(renders[d], "Deployment"):
            if d == "overlays/gpu" and _role(dep) == "router":
                continue
            pod = dep["spec"]["template"]["spec"]
            c = pod["containers"][0]
            shm = [m for m in c["volumeMounts"] if m["mountPath"] == "/dev/shm"]
            assert len(shm) == 1, f"{d} {dep['metadata']['name']}: no /dev/shm mount"
            vol = next(v for v in pod["volumes"] if v["name"] == shm[0]["name"])
            assert vol["emptyDir"]["medium"] == "Memory" and vol["emptyDir"].get("sizeLimit"), \
                f"{d}: /dev/shm is not a sized in-memory emptyDir"
    cpu = renders["overlays/cpu-demo"]
    assert all(x["spec"]["replicas"] == 1 for x in _of(cpu, "Deployment"))
    assert not _of(cpu, "PersistentVolumeClaim")
    for dep in _of(cpu, "Deployment"):
        models = [v for v in dep["spec"]["template"]["spec"]["volumes"] if v["name"] == "models"]
        assert len(models) == 1 and "hostPath" in models[0], f"cpu-demo: {dep['metadata']['name']} models volume"
    for d in ("base", "overlays/gpu", "overlays/autoscale", "overlays/autoscale-hpa"):
        pvc = _one(renders[d], "PersistentVolumeClaim", "tandem-models")
        for dep in _of(renders[d], "Deployment"):
            models = [v for v in dep["spec"]["template"]["spec"]["volumes"] if v["name"] == "models"]
            assert models[0]["persistentVolumeClaim"]["claimName"] == pvc["metadata"]["name"]
    # The demo's Secrets exist in the render, under the names the pods use.
    secrets = {s["metadata"]["name"]: s for s in _of(cpu, "Secret")}
    for dep in _of(cpu, "Deployment"):
        pod = dep["spec"]["template"]["spec"]
        refs = [v["secret"]["secretName"] for v in pod["volumes"] if "secret" in v]
        refs += [e["valueFrom"]["secretKeyRef"]["name"] for e in pod["containers"][0].get("env") or []
                 if "secretKeyRef" in e.get("valueFrom", {})]
        for r in refs:
            assert r in secrets, f"cpu-demo: {dep['metadata']['name']} uses missing Secret {r}"
    tok = next(s for n, s in secrets.items() if n.startswith("tandem-cluster-token"))
    assert "token" in tok["data"]
    gpu = renders["overlays/gpu"]
    for role in ("prefill", "decode"):
        c = _deploy(gpu, role)["spec"]["template"]["spec"]["containers"][0]
        lim = c["resources"]["limits"]
        assert int(lim["nvidia.com/gpu"]) >= 1 and "rdma/ib" in lim
        assert c["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]
        args = _expanded_args(gpu, c)
        tp = _flag_value(args, "--tp")
        assert tp and int(tp[0]) == int(lim["nvidia.com/gpu"]), "gpu: --tp differs from the GPUs per pod"
        assert c["image"] == "tandem:cuda"
    # Outside the gpu overlay nothing adds a capability or asks for a GPU.
    for d in DIRS:
        if d == "overlays/gpu":
            continue
        for dep in _of(renders[d], "Deployment"):
            c = dep["spec"]["template"]["spec"]["containers"][0]
            assert not c["securityContext"]["capabilities"].get("add")
            assert "nvidia.com/gpu" not in (c["resources"].get("limits") or {})


@pytest.mark.parametrize("d", DIRS)
def test_router_discovers_the_headless_services(renders, d):
    objs = renders[d]
    router = _deploy(objs, "router")["spec"]["template"]["spec"]["containers"][0]
    rargs = _expanded_args(objs, router)
    for role in ("prefill", "decode"):
        dns = _flag_value(rargs, f"--{role}-dns")
        assert len(dns) == 1, f"{d}: router has {len(dns)} --{role}-dns"
        host, port = dns[0].rsplit(":", 1)
        svc_name = host.split(".")[0]
        svc = _one(objs, "Service", svc_name)
        assert svc["spec"].get("clusterIP") == "None", f"{d}: {svc_name} is not headless"
        assert svc["metadata"]["labels"]["app.kubernetes.io/component"] == role
        http = next(p for p in svc["spec"]["ports"] if p["name"] == "http")
        assert int(port) == http["port"], f"{d}: router uses {svc_name}:{port}, Service http port is {http['port']}"
        c = _deploy(objs, role)["spec"]["template"]["spec"]["containers"][0]
        assert _flag_value(_expanded_args(objs, c), "--port") == [str(http["port"])], \
            f"{d}: {role} listens elsewhere than its Service's http port"
    # The decode pods reach the prefill pool by its Service's name and http port.
    dec = _deploy(objs, "decode")["spec"]["template"]["spec"]["containers"][0]
    pre = _flag_value(_expanded_args(objs, dec), "--prefill")
    pre_http = next(p for p in _one(objs, "Service", "tandem-prefill")["spec"]["ports"] if p["name"] == "http")
    assert pre == [f"tandem-prefill:{pre_http['port']}"]
    # Every role binds every interface of its pod.
    for role in ROLES:
        c = _deploy(objs, role)["spec"]["template"]["spec"]["containers"][0]
        assert _flag_value(_expanded_args(objs, c), "--host") == ["0.0.0.0"]


def _allowed_from_anywhere(objs, labels, port_name, port_num):
    """Whether some NetworkPolicy rule admits every source on this port of a
    pod with these labels; and whether any policy selects the pod at all."""
    selected = False
    for np in _of(objs, "NetworkPolicy"):
        if not _labels_match(np["spec"]["podSelector"], labels):
            continue
        if "Ingress" not in np["spec"].get("policyTypes", ["Ingress"]):
            continue
        selected = True
        for rule in np["spec"].get("ingress") or []:
            ports = rule.get("ports")
            covers = not ports or any(p.get("port") in (port_name, port_num) for p in ports)
            if covers and not rule.get("from"):
                return True, True
            if covers:
                for peer in rule["from"]:
                    if "ipBlock" in peer and peer["ipBlock"]["cidr"] in ("0.0.0.0/0", "::/0"):
                        return True, True
    return False, selected


def _allowed_from_pod(objs, labels, port_name, port_num, peer_labels):
    for np in _of(objs, "NetworkPolicy"):
        if not _labels_match(np["spec"]["podSelector"], labels):
            continue
        for rule in np["spec"].get("ingress") or []:
            ports = rule.get("ports")
            if ports and not any(p.get("port") in (port_name, port_num) for p in ports):
                continue
            if not rule.get("from"):
                return True
            for peer in rule["from"]:
                if "podSelector" in peer and "namespaceSelector" not in peer and \
                        _labels_match(peer["podSelector"], peer_labels):
                    return True
    return False


@pytest.mark.parametrize("d", DIRS)
def test_network_policy(renders, d):
    objs = renders[d]
    labels = {r: _deploy(objs, r)["spec"]["template"]["metadata"]["labels"] for r in ROLES}
    stranger = {"app.kubernetes.io/name": "something-else"}
    for role in ("prefill", "decode"):
        c = _deploy(objs, role)["spec"]["template"]["spec"]["containers"][0]
        # The declared ports and an arbitrary ephemeral port: UCX's KV
        # transfers use ephemeral TCP ports.
        for name, num in [(p["name"], p["containerPort"]) for p in c["ports"]] + [(None, 41234)]:
            anywhere, selected = _allowed_from_anywhere(objs, labels[role], name, num)
            assert selected, f"{d}: no NetworkPolicy selects the {role} pods"
            assert not anywhere, f"{d}: {role} port {name or num} is open to every source"
            for peer in ROLES:
                assert _allowed_from_pod(objs, labels[role], name, num, labels[peer]), \
                    f"{d}: {peer} pods cannot reach {role} port {name or num}"
            assert not _allowed_from_pod(objs, labels[role], name, num, stranger), \
                f"{d}: other pods can reach {role} port {name or num}"
    rc = _deploy(objs, "router")["spec"]["template"]["spec"]["containers"][0]
    for p in rc["ports"]:
        assert _allowed_from_anywhere(objs, labels["router"], p["name"], p["containerPort"])[0], \
            f"{d}: router port {p['name']} is not public"


# ---------------------------------------------------------------------------
# CRD objects: the fields the project relies on


@pytest.mark.parametrize("d", DIRS)
def test_service_monitor(renders, d):
    objs = renders[d]
    sms = _of(objs, "ServiceMonitor")
    assert len(sms) == 1 and sms[0]["apiVersion"] == "monitoring.coreos.com/v1"
    sm = sms[0]
    if "namespaceSelector" in sm["spec"]:
        assert not sm["spec"]["namespaceSelector"].get("any")
    eps = sm["spec"]["endpoints"]
    assert eps and all(e.get("path", "/metrics") == "/metrics" for e in eps)
    selected = [s for s in _of(objs, "Service") if _labels_match(sm["spec"]["selector"], s["metadata"]["labels"])]
    assert {s["metadata"]["labels"]["app.kubernetes.io/component"] for s in selected} == set(ROLES), \
        f"{d}: the ServiceMonitor selects {[s['metadata']['name'] for s in selected]}"
    for s in selected:
        names = {p["name"] for p in s["spec"]["ports"]}
        for e in eps:
            assert e["port"] in names, f"{d}: Service {s['metadata']['name']} has no port {e['port']}"


# The gauges the autoscalers read, as the binaries export them.
DECODE_METRIC = "vllm:num_requests_waiting"
PREFILL_METRIC = "tandem:prefill_queue_tokens"
# The Services whose pods each pool's autoscaler reads.
WANT_SERVICES = {"tandem-decode": {"tandem-decode", "tandem-router"},
                 "tandem-prefill": {"tandem-prefill"}}


def _autoscaled(objs):
    """Deployment name -> the autoscalers (kind/name) that target it."""
    out = {}
    for o in objs:
        if o["kind"] in ("ScaledObject", "HorizontalPodAutoscaler"):
            ref = o["spec"]["scaleTargetRef"]
            assert ref.get("kind", "Deployment") == "Deployment"
            assert ref.get("apiVersion", "apps/v1") == "apps/v1"
            out.setdefault(ref["name"], []).append(f"{o['kind']}/{o['metadata']['name']}")
    return out


@pytest.mark.parametrize("d", DIRS)
def test_one_autoscaler_per_deployment(renders, d):
    objs = renders[d]
    deployments = {x["metadata"]["name"] for x in _of(objs, "Deployment")}
    for target, scalers in _autoscaled(objs).items():
        assert target in deployments, f"{d}: {scalers} target missing Deployment {target}"
        assert len(scalers) == 1, f"{d}: {target} is scaled by {scalers}"
    if d.startswith("overlays/autoscale"):
        assert set(_autoscaled(objs)) == {"tandem-prefill", "tandem-decode"}
    # the autoscaler owns an autoscaled pool's size: a replica count in the
    # manifest would reset it on every apply
    for x in _of(objs, "Deployment"):
        if x["metadata"]["name"] in _autoscaled(objs):
            assert "replicas" not in x["spec"], f"{d}: {x['metadata']['name']} sets replicas"


def test_keda_scaled_objects(renders):
    objs = renders["overlays/autoscale"]
    ns = {o["metadata"].get("namespace") for o in objs}
    assert len(ns) == 1
    ns = ns.pop()
    sos = _of(objs, "ScaledObject")
    assert len(sos) == 2 and all(s["apiVersion"] == "keda.sh/v1alpha1" for s in sos)
    want = {"tandem-decode": DECODE_METRIC, "tandem-prefill": PREFILL_METRIC}
    for so in sos:
        target = so["spec"]["scaleTargetRef"]["name"]
        _deploy(objs, target.split("-")[1])
        assert 1 <= so["spec"]["minReplicaCount"] <= so["spec"]["maxReplicaCount"]
        trig = so["spec"]["triggers"]
        assert len(trig) == 1 and trig[0]["type"] == "prometheus"
        md = trig[0]["metadata"]
        assert md["serverAddress"].startswith("http")
        assert float(md["threshold"]) > 0 and isinstance(md["threshold"], str)
        q = md["query"]
        metric, matchers = promql_sum.parse(q)
        assert metric == want[target], f"{target}: query {q!r} does not read {want[target]}"
        # The query reads this render's namespace and the Services (the
        # label Prometheus gives the ServiceMonitor's targets) of the pool's
        # own pods, and for decode the routers' too (their queue is the
        # decode pool's demand when no decode pod has KV headroom).
        services = {x["metadata"]["name"] for x in _of(objs, "Service")}
        read = {n for n in services
                if promql_sum.matches(matchers, {"namespace": ns, "service": n})}
        assert read == WANT_SERVICES[target], f"{target}: query {q!r} reads {read}"
        assert not any(promql_sum.matches(matchers, {"namespace": "other", "service": n})
                       for n in services), f"{target}: query {q!r} reads other namespaces"


def test_hpa_alternative(renders):
    objs = renders["overlays/autoscale-hpa"]
    rules = yaml.safe_load((K8S / "overlays/autoscale-hpa/adapter-rules.yaml").read_text())["rules"]
    exported, resources = {}, {}
    for r in rules:
        series = re.match(r"^'?([a-z_:]+)\{", r["seriesQuery"]).group(1)
        assert re.fullmatch(r["name"]["matches"], series)
        exported[r["name"]["as"]] = series
        resources[r["name"]["as"]] = {v["resource"] for v in r["resources"]["overrides"].values()}
    want = {"tandem-decode": DECODE_METRIC, "tandem-prefill": PREFILL_METRIC}
    hpas = _of(objs, "HorizontalPodAutoscaler")
    assert len(hpas) == 2
    for h in hpas:
        assert h["apiVersion"] == "autoscaling/v2"
        target = h["spec"]["scaleTargetRef"]["name"]
        read = set()
        for m in h["spec"]["metrics"]:
            if m["type"] == "Pods":  # the pool's own pods
                name = m["pods"]["metric"]["name"]
                assert "pod" in resources.get(name, set()), f"{target}: {name} is not per pod"
                read.add(target)
            else:  # another pool's Service: the routers'
                assert m["type"] == "Object", m
                ob = m["object"]["describedObject"]
                assert ob["kind"] == "Service" and ob["apiVersion"] == "v1", ob
                _one(objs, "Service", ob["name"])
                name = m["object"]["metric"]["name"]
                assert "service" in resources.get(name, set()), f"{target}: {name} has no Service"
                read.add(ob["name"])
            assert exported.get(name) == want[target], f"{target}: metric {name} is not {want[target]} via the adapter"
        assert read == WANT_SERVICES[target], f"{target}: the HPA reads {read}"


def test_metric_names_are_exported():
    """The autoscalers' gauges are the names the C sources export."""
    text = (K8S.parent.parent / "common" / "obs" / "metrics.c").read_text()
    for m in (DECODE_METRIC, PREFILL_METRIC):
        assert f'"{m}"' in text, f"{m} is not exported by common/obs/metrics.c"


# ---------------------------------------------------------------------------
# The real binaries accept the manifests' arguments


def _help_flags(binary):
    """flag -> takes a value, from the lines of `BINARY --help` that start with a flag
    (after its short name, if it has one: "  -m, --model PATH")."""
    p = subprocess.run([str(binary), "--help"], capture_output=True, text=True, timeout=30)
    assert p.returncode == 0, f"{binary} --help exited {p.returncode}"
    flags = {}
    for line in p.stdout.splitlines():
        m = re.match(r"^\s+(?:-[a-zA-Z], )?(--[a-z][a-z0-9-]*)( \S+)?", line)
        if m:
            flags[m.group(1)] = m.group(2) is not None
    assert len(flags) > 10, f"{binary} --help lists too few flags"
    return flags


@pytest.fixture(scope="module")
def bins():
    bd = os.environ.get("TANDEM_BUILD_DIR")
    if not bd:
        pytest.skip("TANDEM_BUILD_DIR is not set: the binaries' flags are not checked")
    out = {}
    for b in ("tandem-router", "tandem-prefill", "tandem-decode"):
        path = pathlib.Path(bd) / b
        assert path.exists(), f"{path} not built"
        out[b] = (path, _help_flags(path))
    return out


@pytest.mark.parametrize("d", DIRS)
def test_binaries_accept_the_args(renders, bins, d):
    objs = renders[d]
    for dep in _of(objs, "Deployment"):
        for c in dep["spec"]["template"]["spec"]["containers"]:
            cmd = c["command"]
            assert len(cmd) == 1 and cmd[0].startswith("/usr/local/bin/"), f"{d}: command {cmd}"
            name = pathlib.PurePosixPath(cmd[0]).name
            path, flags = bins[name]
            args = _expanded_args(objs, c)
            i = 0
            while i < len(args):
                a = args[i]
                assert a.startswith("--") and "=" not in a, f"{d} {name}: stray argument {a!r} at {i}"
                assert a in flags, f"{d} {name}: {a} is not in `{name} --help`"
                if flags[a]:
                    assert i + 1 < len(args) and not args[i + 1].startswith("--"), f"{d} {name}: {a} has no value"
                    i += 2
                else:
                    i += 1
            # The binary's own parser takes every option and value: it parses
            # them in order and stops at the trailing --help (exit 0) or
            # rejects an unknown option or a bad value (exit 2).
            p = subprocess.run([str(path), *args, "--help"], capture_output=True, text=True, timeout=30)
            assert p.returncode == 0, f"{d} {name} rejects its manifest's args {args}:\n{p.stderr}"
