#!/usr/bin/env python3
"""Mutations of the trusted-tcp overlay that validate_manifests.py must fail.

The data plane opens TCP ports only with --ucx-tcp-trusted-network=true, and
then only behind a NetworkPolicy that admits them from labelled client pods
(docs/operations.md, "Security"). Each mutation below breaks one of those
rules; the unmutated rendering must pass.

Usage: check_data_plane_rules.py RENDERED_TRUSTED_TCP.yaml
"""
import copy
import os
import sys

import yaml

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import validate_manifests as vm  # noqa: E402


def of_kind(docs, kind):
    return [d for d in docs if d["kind"] == kind]


def container(docs):
    sts = of_kind(docs, "StatefulSet")[0]
    return next(c for c in sts["spec"]["template"]["spec"]["containers"] if c["name"] == "kvcache-node")


def set_flags(docs, edit):
    cm = of_kind(docs, "ConfigMap")[0]
    lines = [l for l in cm["data"]["node.flags"].splitlines() if l.strip()]
    cm["data"]["node.flags"] = "\n".join(edit(lines)) + "\n"


def drop_policy(docs):
    docs[:] = [d for d in docs if d["kind"] != "NetworkPolicy"]


def open_to_all(docs):
    for rule in of_kind(docs, "NetworkPolicy")[0]["spec"]["ingress"]:
        rule.pop("from", None)


def from_namespace(docs):
    for rule in of_kind(docs, "NetworkPolicy")[0]["spec"]["ingress"]:
        if "from" in rule:
            rule["from"] = [{"namespaceSelector": {}}]


def drop_port_range(docs):
    c = container(docs)
    c["env"] = [e for e in c["env"] if e["name"] != "UCX_TCP_PORT_RANGE"]


def drop_opt_in(docs):
    set_flags(docs, lambda ls: [l for l in ls if not l.startswith("--ucx-tcp-trusted-network")])


def ports_without_opt_in(docs):
    set_flags(docs, lambda ls: [l for l in ls if not l.startswith(("--ucx-tcp-trusted-network", "--ucx-listen"))])


MUTATIONS = [drop_policy, open_to_all, from_namespace, drop_port_range, drop_opt_in, ports_without_opt_in]


def main():
    docs = [d for d in yaml.safe_load_all(open(sys.argv[1])) if d]
    failed = 0
    errs = vm.policy_errors(copy.deepcopy(docs), "trusted-tcp")
    if errs:
        print(f"FAIL unmutated trusted-tcp: {errs}")
        failed += 1
    for mutate in MUTATIONS:
        mutated = copy.deepcopy(docs)
        mutate(mutated)
        errs = vm.policy_errors(mutated, "trusted-tcp")
        if errs:
            print(f"ok {mutate.__name__}: {errs[0]}")
        else:
            print(f"FAIL {mutate.__name__}: the validator accepted it")
            failed += 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
