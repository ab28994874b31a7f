#!/usr/bin/env python3
"""Strict, offline validation of rendered kvcache manifests.

    kubectl kustomize deploy/k8s/overlays/gpu > /tmp/gpu.yaml
    python3 tests/deploy/validate_manifests.py --overlay gpu /tmp/gpu.yaml

1. Schema: every object is validated against the Kubernetes JSON schemas of
   each --kubernetes-version (kubernetes-validate, strict: unknown fields are
   errors). The Prometheus Operator kinds (PodMonitor, ServiceMonitor,
   PrometheusRule) are validated against JSON schemas derived from the
   operator's CRD models (the cloudcoil-models-prometheus-operator package),
   made strict the same way. A kind with no schema is an error.
2. Policy: the things the kvcache deployment relies on and no schema checks:
   probes are native gRPC probes on the health port the flags file sets,
   the grace period exceeds --drain-timeout, selectors match, the GPU sits
   under limits in the gpu/rdma overlays, --tenants names a key of a Secret
   mounted as a directory, and so on.

Exit status 0 when everything passes, 1 otherwise.
"""
import argparse
import functools
import re
import sys

import jsonschema
import kubernetes_validate
import yaml
from kubernetes_validate import utils as kv_utils

DEFAULT_VERSIONS = ["1.29", kv_utils.latest_version()]
OPERATOR_KINDS = {"PodMonitor", "ServiceMonitor", "PrometheusRule"}


def strictify(node):
    """Forbids properties a schema does not list, like kubernetes-validate --strict.

    Also turns pydantic's optional fields, anyOf: [X, {type: null}], into X
    (a manifest never needs an explicit null), which keeps error messages
    pointed at the offending field instead of the whole anyOf.
    """
    if isinstance(node, dict):
        alts = node.get("anyOf")
        if isinstance(alts, list) and len(alts) == 2 and {"type": "null"} in alts:
            (other,) = [a for a in alts if a != {"type": "null"}]
            del node["anyOf"]
            node.update({k: v for k, v in other.items() if k not in node})
        if node.get("properties") and "additionalProperties" not in node:
            node["additionalProperties"] = False
        for v in node.values():
            strictify(v)
    elif isinstance(node, list):
        for v in node:
            strictify(v)
    return node


def short(msg, limit=240):
    return msg if len(msg) <= limit else msg[:limit] + "..."


@functools.lru_cache(maxsize=None)
def operator_schema(kind):
    from cloudcoil.models.prometheus_operator import v1  # slow import: only when needed
    schema = getattr(v1, kind).model_json_schema(by_alias=True, mode="validation")
    return strictify(schema)


def schema_errors(doc, versions):
    kind, api = doc.get("kind"), doc.get("apiVersion", "")
    where = f"{kind}/{doc.get('metadata', {}).get('name')}"
    errs = []
    if kind in OPERATOR_KINDS:
        if api != "monitoring.coreos.com/v1":
            return [f"{where}: apiVersion {api!r}, expected monitoring.coreos.com/v1"]
        v = jsonschema.Draft202012Validator(operator_schema(kind))
        for e in sorted(v.iter_errors(doc), key=lambda e: list(map(str, e.path))):
            e = jsonschema.exceptions.best_match([e])
            errs.append(f"{where}: {'.'.join(map(str, e.path)) or '<root>'}: {short(e.message)}")
        return errs
    for version in versions:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            errs.append(f"{where} (k8s {version}): {'.'.join(map(str, e.path))}: {short(e.message)}")
        except kv_utils.SchemaNotFoundError as e:
            errs.append(f"{where}: {e.message}")
    return errs


# ---------------------------------------------------------------------------
# Policy checks


def parse_flags(text):
    flags = {}
    for line in text.splitlines():
        line = line.strip()
        if not line:
            continue
        m = re.fullmatch(r"--([a-z0-9-]+)=(.*)", line)
        if not m:
            raise ValueError(f"flags file line is not --flag=value: {line!r}")
        flags[m.group(1)] = m.group(2)
    return flags


def port_of(hostport):
    return int(hostport.rsplit(":", 1)[1])


def quantity_gi(q):
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
    m = re.fullmatch(r"(\d+)(Ki|Mi|Gi|Ti)?", str(q))
    if not m:
        raise ValueError(f"unsupported quantity {q!r}")
    return int(m.group(1)) * units.get(m.group(2), 1) / 2**30


def matches(selector, labels):
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def tenants_errors(flags, spec, container, by_kind):
    """--tenants names a key of a Secret mounted as a directory (not a
    subPath: the kubelet then updates the file in place and the node reloads
    it) that the output holds."""
    path = flags.get("tenants")
    if not path:
        return ["node.flags lacks --tenants (the nodes would run open)"]
    directory, _, key = path.rpartition("/")
    mounts = [m for m in container.get("volumeMounts", []) if m["mountPath"] == directory]
    if not mounts:
        return [f"--tenants={path}: no volume is mounted at {directory}"]
    if mounts[0].get("subPath"):
        return [f"--tenants={path}: mounted with subPath, so Secret updates never reach it"]
    vols = {v["name"]: v for v in spec.get("volumes", [])}
    secret = vols.get(mounts[0]["name"], {}).get("secret", {}).get("secretName")
    if not secret:
        return [f"--tenants={path}: the volume at {directory} is not a Secret"]
    found = [s for s in by_kind.get("Secret", []) if s["metadata"]["name"] == secret]
    if not found:
        return [f"--tenants={path}: Secret {secret} is not in the output"]
    data = {**found[0].get("data", {}), **found[0].get("stringData", {})}
    if key not in data:
        return [f"--tenants={path}: Secret {secret} has no key {key}"]
    return []


def data_plane_errors(flags, container, ports, labels, policies):
    """The data plane opens TCP ports only with the trusted-network opt-in,
    and then pinned, declared, and admitted only from client pods."""
    errs = []
    tcp = flags.get("ucx-tcp-trusted-network") == "true"
    if "ucx-listen" in flags and not tcp:
        errs.append("--ucx-listen without --ucx-tcp-trusted-network=true (the node refuses to start)")
    if flags.get("data-plane") != "ucx" or not tcp:
        for name in ("ucx", "ucx-tcp"):
            if name in ports:
                errs.append(f"container port {name} declared, but the node opens no UCX TCP port without the opt-in")
        return errs
    if "ucx-listen" in flags and ports.get("ucx") != port_of(flags["ucx-listen"]):
        errs.append(f"container port ucx={ports.get('ucx')} but --ucx-listen={flags['ucx-listen']}")
    # Over TCP the data flows on UCX's interface port, random unless
    # UCX_TCP_PORT_RANGE pins it: pinned, and declared as ucx-tcp.
    env = {e["name"]: e.get("value") for e in container.get("env", [])}
    pinned = env.get("UCX_TCP_PORT_RANGE", "")
    low, _, high = pinned.partition("-")
    if not (low.isdigit() and high.isdigit()):
        errs.append(f"UCX over TCP without a UCX_TCP_PORT_RANGE of LOW-HIGH ({pinned!r})")
        return errs
    if not int(low) <= ports.get("ucx-tcp", -1) <= int(high):
        errs.append(f"container port ucx-tcp={ports.get('ucx-tcp')} outside UCX_TCP_PORT_RANGE={pinned}")
    # A NetworkPolicy over the nodes admitting the UCX ports only from pods
    # selected by label (never from everywhere).
    ucx_ports = {p for n, p in ports.items() if n in ("ucx", "ucx-tcp")}
    guarding = [np for np in policies if matches(np["spec"].get("podSelector", {}), labels)
                and "Ingress" in np["spec"].get("policyTypes", ["Ingress"])]
    if not guarding:
        errs.append("UCX over TCP without a NetworkPolicy selecting the nodes")
    for np in guarding:
        for rule in np["spec"].get("ingress", []):
            rule_ports = {p.get("port") for p in rule.get("ports", [])} or None
            opens_ucx = rule_ports is None or bool(rule_ports & ucx_ports)
            sources = rule.get("from", [])
            by_label = sources and all(set(src) == {"podSelector"} and src["podSelector"].get("matchLabels")
                                       for src in sources)
            if opens_ucx and not by_label:
                errs.append(f"NetworkPolicy {np['metadata']['name']} admits UCX ports {sorted(ucx_ports)} from other than labelled client pods")
    return errs


def policy_errors(docs, overlay):
    errs = []
    by_kind = {}
    for d in docs:
        by_kind.setdefault(d["kind"], []).append(d)

    def one(kind):
        items = by_kind.get(kind, [])
        if len(items) != 1:
            errs.append(f"expected exactly one {kind}, found {len(items)}")
            return None
        return items[0]

    sts, svc, cm, pdb = one("StatefulSet"), one("Service"), one("ConfigMap"), one("PodDisruptionBudget")
    if not (sts and svc and cm and pdb):
        return errs
    pod = sts["spec"]["template"]
    labels = pod["metadata"]["labels"]
    spec = pod["spec"]
    if not matches(sts["spec"]["selector"], labels):
        errs.append("StatefulSet selector does not match its pod labels")
    # Headless governing Service for client-side sharding.
    if sts["spec"].get("serviceName") != svc["metadata"]["name"]:
        errs.append("StatefulSet serviceName is not the Service")
    if svc["spec"].get("clusterIP") != "None":
        errs.append("Service is not headless (clusterIP: None)")
    if not all(labels.get(k) == v for k, v in svc["spec"]["selector"].items()):
        errs.append("Service selector does not match the pods")
    if not matches(pdb["spec"]["selector"], labels):
        errs.append("PodDisruptionBudget selector does not match the pods")

    # Flags file from the ConfigMap, mounted and passed with --config.
    flags_text = cm["data"].get("node.flags")
    if flags_text is None:
        errs.append("ConfigMap has no node.flags")
        return errs
    flags = parse_flags(flags_text)
    for f in ("listen", "health-listen", "metrics-listen", "drain-timeout"):
        if f not in flags:
            errs.append(f"node.flags lacks --{f}")
    if "memory" in flags:
        errs.append("node.flags must not set --memory (the entrypoint sizes it from the pod's resources)")
    if errs:
        return errs
    vols = {v["name"]: v for v in spec.get("volumes", [])}
    cm_vols = [n for n, v in vols.items() if v.get("configMap", {}).get("name") == cm["metadata"]["name"]]
    if not cm_vols:
        errs.append("no volume mounts the flags ConfigMap")

    containers = {c["name"]: c for c in spec["containers"]}
    c = containers.get("kvcache-node")
    if c is None:
        errs.append("no container named kvcache-node")
        return errs
    mounts = {m["name"]: m["mountPath"] for m in c.get("volumeMounts", [])}
    if not any(f"--config={mounts.get(v, '?')}/node.flags" in c.get("args", []) for v in cm_vols):
        errs.append("container args lack --config=<flags mount>/node.flags")
    ports = {p["name"]: p["containerPort"] for p in c.get("ports", [])}
    for name, flag in (("grpc", "listen"), ("health", "health-listen"), ("metrics", "metrics-listen")):
        if ports.get(name) != port_of(flags[flag]):
            errs.append(f"container port {name}={ports.get(name)} but --{flag}={flags[flag]}")
    errs += data_plane_errors(flags, c, ports, labels, by_kind.get("NetworkPolicy", []))
    health = port_of(flags["health-listen"])
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        p = c.get(probe)
        if not p or "grpc" not in p:
            errs.append(f"{probe} is not a native gRPC probe")
        elif p["grpc"].get("port") != health:
            errs.append(f"{probe} probes port {p['grpc'].get('port')}, health port is {health}")
    errs += tenants_errors(flags, spec, c, by_kind)
    grace = spec.get("terminationGracePeriodSeconds", 30)
    drain = int(flags["drain-timeout"])
    if grace <= drain:
        errs.append(f"terminationGracePeriodSeconds {grace} <= --drain-timeout {drain}")
    svc_ports = {p["name"]: p for p in svc["spec"]["ports"]}
    if svc_ports.get("grpc", {}).get("port") != ports["grpc"]:
        errs.append("Service grpc port differs from the container's")

    # Non-root, read-only root, no privilege escalation.
    psc, csc = spec.get("securityContext", {}), c.get("securityContext", {})
    if not psc.get("runAsNonRoot") or not psc.get("runAsUser"):
        errs.append("pod must run as a non-root user")
    if csc.get("allowPrivilegeEscalation") is not False or csc.get("readOnlyRootFilesystem") is not True:
        errs.append("container must set allowPrivilegeEscalation=false, readOnlyRootFilesystem=true")
    if "ALL" not in csc.get("capabilities", {}).get("drop", []):
        errs.append("container must drop ALL capabilities")

    # Memory tier sized from the pod's resources.
    env = {e["name"]: e for e in c.get("env", [])}
    res = c.get("resources", {})
    limits, requests = res.get("limits", {}), res.get("requests", {})
    lim_env = env.get("KVCACHE_MEMORY_LIMIT_BYTES", {}).get("valueFrom", {}).get("resourceFieldRef", {})
    if lim_env.get("resource") != "limits.memory" or lim_env.get("containerName") != "kvcache-node":
        errs.append("KVCACHE_MEMORY_LIMIT_BYTES must come from the downward API (limits.memory)")
    if "memory" not in limits:
        errs.append("container has no memory limit to size the pool from")
    elif requests.get("memory") and quantity_gi(requests["memory"]) != quantity_gi(limits["memory"]):
        errs.append("memory request should equal the limit (the pool is allocated up front)")
    tier = env.get("KVCACHE_MEMORY_TIER", {}).get("value")
    gpu = limits.get("nvidia.com/gpu")
    if overlay in ("gpu", "rdma"):
        if not gpu:
            errs.append(f"{overlay}: nvidia.com/gpu must be set under limits")
        if tier != "gpu":
            errs.append(f"{overlay}: KVCACHE_MEMORY_TIER must be gpu, is {tier!r}")
        if "nvidia.com/gpu" in requests and requests["nvidia.com/gpu"] != gpu:
            errs.append(f"{overlay}: nvidia.com/gpu request differs from the limit")
    elif overlay in ("cpu-only", "base", "trusted-tcp"):
        if gpu or "nvidia.com/gpu" in requests:
            errs.append(f"{overlay}: must not request GPUs")
        if tier != "host":
            errs.append(f"{overlay}: KVCACHE_MEMORY_TIER must be host, is {tier!r}")
    if overlay == "rdma":
        if not any(k.startswith("rdma/") or "rdma" in k for k in limits):
            errs.append("rdma: no RDMA device resource under limits")
        if "IPC_LOCK" not in csc.get("capabilities", {}).get("add", []):
            errs.append("rdma: IPC_LOCK capability is needed to register memory")

    # Monitoring component: the PodMonitor must find the pods and their port.
    for pm in by_kind.get("PodMonitor", []):
        if not matches(pm["spec"]["selector"], labels):
            errs.append("PodMonitor selector does not match the pods")
        for ep in pm["spec"].get("podMetricsEndpoints", []):
            if ep.get("port") not in ports:
                errs.append(f"PodMonitor endpoint port {ep.get('port')!r} is not a container port")
        job_label = pm["spec"].get("jobLabel")
        if labels.get(job_label) != "kvcache":
            errs.append("PodMonitor jobLabel must yield job=\"kvcache\" (the alerts select it)")
    if overlay != "base" and not by_kind.get("PrometheusRule"):
        errs.append("no PrometheusRule in the output")
    return errs


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+", help="rendered multi-document YAML ('-' for stdin)")
    ap.add_argument("--kubernetes-version", "-k", action="append", dest="versions",
                    help=f"repeatable; default {' and '.join(DEFAULT_VERSIONS)}")
    ap.add_argument("--overlay", default="", help="gpu, cpu-only, rdma, trusted-tcp or base: enables its policy checks")
    args = ap.parse_args()
    versions = args.versions or DEFAULT_VERSIONS
    failed = 0
    for f in args.files:
        text = sys.stdin.read() if f == "-" else open(f).read()
        docs = [d for d in yaml.safe_load_all(text) if d]
        errs = []
        for d in docs:
            errs += schema_errors(d, versions)
        errs += [f"policy: {e}" for e in policy_errors(docs, args.overlay)]
        label = args.overlay or f
        for e in errs:
            print(f"FAIL {label}: {e}")
        if errs:
            failed += 1
        else:
            kinds = ", ".join(sorted({d["kind"] for d in docs}))
            print(f"ok {label}: {len(docs)} objects valid (k8s {', '.join(versions)}; {kinds})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
