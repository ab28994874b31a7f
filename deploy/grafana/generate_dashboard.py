#!/usr/bin/env python3
"""Generates deploy/grafana/kvcache-dashboard.json.

The dashboard is written as code so that panel ids and grid positions stay
consistent; edit this file, then run it:

    python3 deploy/grafana/generate_dashboard.py          # rewrite the JSON
    python3 deploy/grafana/generate_dashboard.py --check  # fail if stale

Variables: datasource (a Prometheus), job (default kvcache), instance (one
node, several, or All = the total over all nodes) and kv_namespace (the KV
namespace of kvcache_token_capacity_remaining). Every panel shows the total
over the selected nodes and/or one series per node (instance).
"""
import argparse
import json
import pathlib
import sys

OUT = pathlib.Path(__file__).with_name("kvcache-dashboard.json")
DS = {"type": "prometheus", "uid": "${datasource}"}
# Selector of the chosen nodes; every query uses it.
S = 'job="$job",instance=~"$instance"'
RI = "$__rate_interval"


class Layout:
    """Places panels left to right on Grafana's 24-column grid."""

    def __init__(self):
        self.panels = []
        self.next_id = 1
        self.x = 0
        self.y = 0
        self.row_h = 0

    def _place(self, w, h):
        if self.x + w > 24:
            self.x, self.y, self.row_h = 0, self.y + self.row_h, 0
        pos = {"h": h, "w": w, "x": self.x, "y": self.y}
        self.x += w
        self.row_h = max(self.row_h, h)
        return pos

    def _id(self):
        i = self.next_id
        self.next_id += 1
        return i

    def row(self, title):
        if self.x:
            self.x, self.y, self.row_h = 0, self.y + self.row_h, 0
        self.panels.append({"type": "row", "title": title, "id": self._id(), "collapsed": False,
                            "gridPos": {"h": 1, "w": 24, "x": 0, "y": self.y}, "panels": []})
        self.y += 1

    def add(self, panel, w, h):
        panel["id"] = self._id()
        panel["gridPos"] = self._place(w, h)
        self.panels.append(panel)


def target(expr, legend="", ref="A", instant=False, fmt=None):
    t = {"datasource": DS, "expr": expr, "legendFormat": legend, "refId": ref,
         "range": not instant, "instant": instant}
    if fmt:
        t["format"] = fmt
    return t


def targets(*pairs):
    return [target(e, l, chr(ord("A") + i)) for i, (e, l) in enumerate(pairs)]


def timeseries(title, desc, tgts, unit="short", stack=False, thresholds=None, min_zero=True):
    defaults = {"unit": unit, "custom": {"drawStyle": "line", "lineWidth": 1, "fillOpacity": 10,
                                         "showPoints": "never", "spanNulls": False,
                                         "stacking": {"mode": "normal" if stack else "none", "group": "A"}}}
    if min_zero:
        defaults["min"] = 0
    if thresholds:
        defaults["thresholds"] = {"mode": "absolute", "steps": [{"color": "green", "value": None}] +
                                  [{"color": c, "value": v} for v, c in thresholds]}
        defaults["custom"]["thresholdsStyle"] = {"mode": "line"}
    return {"type": "timeseries", "title": title, "description": desc, "datasource": DS,
            "targets": tgts, "fieldConfig": {"defaults": defaults, "overrides": []},
            "options": {"legend": {"displayMode": "table", "placement": "bottom",
                                   "calcs": ["lastNotNull", "max"]},
                        "tooltip": {"mode": "multi", "sort": "desc"}}}


def stat(title, desc, expr, unit="short", thresholds=None, decimals=None):
    defaults = {"unit": unit, "thresholds": {"mode": "absolute", "steps": [{"color": "green", "value": None}] +
                                             [{"color": c, "value": v} for v, c in (thresholds or [])]}}
    if decimals is not None:
        defaults["decimals"] = decimals
    return {"type": "stat", "title": title, "description": desc, "datasource": DS,
            "targets": [target(expr, instant=True)],
            "fieldConfig": {"defaults": defaults, "overrides": []},
            "options": {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                        "colorMode": "value", "graphMode": "none", "textMode": "auto",
                        "justifyMode": "auto", "orientation": "auto"}}


def hit_ratio(by=""):
    grp = f" by ({by})" if by else ""
    return (f'sum{grp} (rate(kvcache_lookup_blocks_total{{{S},result="hit"}}[{RI}]))'
            f' / sum{grp} (rate(kvcache_lookup_blocks_total{{{S}}}[{RI}]))')


def compression(by=""):
    grp = f" by ({by})" if by else ""
    return f"sum{grp} (kvcache_logical_bytes{{{S}}}) / sum{grp} (kvcache_pool_used_bytes{{{S}}})"


def quantile(q, metric, by):
    return f"histogram_quantile({q}, sum by (le, {by}) (rate({metric}_bucket{{{S}}}[{RI}])))"


def build():
    L = Layout()

    L.row("Overview (selected nodes)")
    L.add(stat("Nodes up", "Scrape targets answering (Prometheus `up`).",
               f"sum(up{{{S}}})"), 4, 4)
    L.add(stat("Nodes ready", "Nodes serving (kvcache_ready = 1); 0 while draining.",
               f"sum(kvcache_ready{{{S}}})"), 4, 4)
    L.add(stat("Pool used", "Used bytes over capacity, all selected nodes.",
               f"sum(kvcache_pool_used_bytes{{{S}}}) / sum(kvcache_pool_capacity_bytes{{{S}}})",
               unit="percentunit", thresholds=[(0.8, "orange"), (0.9, "red")]), 4, 4)
    L.add(stat("Block hit rate (5m)", "Blocks found over blocks looked up, last 5 minutes.",
               f'sum(rate(kvcache_lookup_blocks_total{{{S},result="hit"}}[5m]))'
               f" / sum(rate(kvcache_lookup_blocks_total{{{S}}}[5m]))", unit="percentunit"), 4, 4)
    L.add(stat("Effective compression", "fp16 bytes the stored blocks represent over pool bytes used "
               "(sum(kvcache_logical_bytes) / sum(kvcache_pool_used_bytes)).",
               compression(), unit="none", decimals=2), 4, 4)
    L.add(stat("Data-loss events", "Blocks that failed checksum/header checks on read in the time range.",
               f"sum(increase(kvcache_data_loss_total{{{S}}}[$__range]))",
               thresholds=[(1, "red")], decimals=0), 4, 4)

    L.row("Capacity")
    L.add(timeseries("Pool bytes (total)", "Capacity and used bytes summed over the selected nodes.",
                     targets((f"sum(kvcache_pool_capacity_bytes{{{S}}})", "capacity"),
                             (f"sum(kvcache_pool_used_bytes{{{S}}})", "used")), unit="bytes"), 12, 8)
    L.add(timeseries("Pool used per node", "Used bytes of each node's pool.",
                     targets((f"sum by (instance) (kvcache_pool_used_bytes{{{S}}})", "{{instance}} used"),
                             (f"sum by (instance) (kvcache_pool_capacity_bytes{{{S}}})", "{{instance}} capacity")),
                     unit="bytes"), 12, 8)
    L.add(timeseries("Pool used ratio per node", "Alert KvcacheCapacityHigh fires above 0.9 for 15m.",
                     targets((f"kvcache_pool_used_ratio{{{S}}}", "{{instance}}")),
                     unit="percentunit", thresholds=[(0.9, "red")]), 12, 8)
    L.add(timeseries("Fragmentation, pinned and reserved bytes per node",
                     "Free bytes unusable for a new block (fragmentation), bytes pinned by reads and lookups, "
                     "bytes reserved by open write leases.",
                     targets((f"sum by (instance) (kvcache_pool_fragmentation_bytes{{{S}}})", "{{instance}} fragmentation"),
                             (f"sum by (instance) (kvcache_pinned_bytes{{{S}}})", "{{instance}} pinned"),
                             (f"sum by (instance) (kvcache_pool_reserved_bytes{{{S}}})", "{{instance}} reserved")),
                     unit="bytes"), 12, 8)
    L.add(timeseries("Stored tokens per codec (total)", "Tokens held, summed over the selected nodes.",
                     targets((f"sum by (codec) (kvcache_stored_tokens{{{S}}})", "{{codec}}")), stack=True), 12, 8)
    L.add(timeseries("Stored tokens per node and codec", "Tokens held by each node, per codec.",
                     targets((f"sum by (instance, codec) (kvcache_stored_tokens{{{S}}})", "{{instance}} {{codec}}"))),
          12, 8)
    L.add(timeseries("Blocks per codec (total)", "Blocks held, summed over the selected nodes.",
                     targets((f"sum by (codec) (kvcache_blocks{{{S}}})", "{{codec}}")), stack=True), 12, 8)
    L.add(timeseries("Logical (fp16) bytes per codec (total)",
                     "Bytes the stored blocks would take uncompressed in fp16.",
                     targets((f"sum by (codec) (kvcache_logical_bytes{{{S}}})", "{{codec}}")),
                     unit="bytes", stack=True), 12, 8)
    L.add(timeseries("Tokens that still fit (total)",
                     "Free pool space in tokens, per registered namespace layout and codec, summed over the "
                     "selected nodes. Different namespaces are alternatives, not additive.",
                     targets((f'sum by (kv_namespace, codec) (kvcache_token_capacity_remaining{{{S},kv_namespace=~"$kv_namespace"}})',
                              "{{kv_namespace}} {{codec}}"))), 12, 8)
    L.add(timeseries("Tokens that still fit per node",
                     "Free pool space of each node in tokens, per namespace layout and codec.",
                     targets((f'sum by (instance, kv_namespace, codec) (kvcache_token_capacity_remaining{{{S},kv_namespace=~"$kv_namespace"}})',
                              "{{instance}} {{kv_namespace}} {{codec}}"))), 12, 8)
    L.add(timeseries("Effective compression ratio",
                     "sum(kvcache_logical_bytes) / sum(kvcache_pool_used_bytes): total and per node.",
                     targets((compression(), "total"), (compression("instance"), "{{instance}}")),
                     unit="none"), 24, 8)

    L.row("Traffic")
    L.add(timeseries("Block hit rate", "Blocks found over blocks looked up: total and per node.",
                     targets((hit_ratio(), "total"), (hit_ratio("instance"), "{{instance}}")),
                     unit="percentunit"), 12, 8)
    L.add(timeseries("Lookup blocks/s", "Blocks looked up per second, hits and misses (total).",
                     targets((f"sum by (result) (rate(kvcache_lookup_blocks_total{{{S}}}[{RI}]))", "{{result}}")),
                     unit="ops", stack=True), 12, 8)
    L.add(timeseries("Requests/s by op (total)", "gRPC calls per second, all codes.",
                     targets((f"sum by (op) (rate(kvcache_requests_total{{{S}}}[{RI}]))", "{{op}}")),
                     unit="reqps"), 12, 8)
    L.add(timeseries("Errors/s by op and code (total)", "gRPC calls per second that did not return OK.",
                     targets((f'sum by (op, code) (rate(kvcache_requests_total{{{S},code!="OK"}}[{RI}]))',
                              "{{op}} {{code}}")), unit="reqps"), 12, 8)
    L.add(timeseries("Requests/s per node", "gRPC calls per second per node, all ops.",
                     targets((f"sum by (instance) (rate(kvcache_requests_total{{{S}}}[{RI}]))", "{{instance}}")),
                     unit="reqps"), 12, 8)
    L.add(timeseries("Transfer throughput (total)", "Block payload bytes per second by direction and transport.",
                     targets((f"sum by (direction, transport) (rate(kvcache_transfer_bytes_total{{{S}}}[{RI}]))",
                              "{{direction}} {{transport}}")), unit="Bps"), 12, 8)
    L.add(timeseries("Transfer throughput per node", "Block payload bytes per second per node and direction.",
                     targets((f"sum by (instance, direction) (rate(kvcache_transfer_bytes_total{{{S}}}[{RI}]))",
                              "{{instance}} {{direction}}")), unit="Bps"), 12, 8)
    L.add(timeseries("Active leases", "Read and write leases held (total and per node), and leases that "
                     "expired before their client ended them (per second, total).",
                     targets((f"sum by (kind) (kvcache_active_leases{{{S}}})", "total {{kind}}"),
                             (f"sum by (instance, kind) (kvcache_active_leases{{{S}}})", "{{instance}} {{kind}}"),
                             (f"sum(rate(kvcache_leases_expired_total{{{S}}}[{RI}]))", "expired/s"))),
          12, 8)

    L.row("Latency")
    L.add(timeseries("Request latency p50 / p99 by op (total)", "From kvcache_request_duration_seconds.",
                     targets((quantile(0.5, "kvcache_request_duration_seconds", "op"), "p50 {{op}}"),
                             (quantile(0.99, "kvcache_request_duration_seconds", "op"), "p99 {{op}}")),
                     unit="s"), 12, 8)
    L.add(timeseries("Request latency p90 by op (total)", "From kvcache_request_duration_seconds.",
                     targets((quantile(0.9, "kvcache_request_duration_seconds", "op"), "p90 {{op}}")),
                     unit="s"), 12, 8)
    L.add(timeseries("Request latency p99 per node (all ops)", "From kvcache_request_duration_seconds.",
                     targets((quantile(0.99, "kvcache_request_duration_seconds", "instance"), "{{instance}}")),
                     unit="s"), 12, 8)
    L.add(timeseries("Mean request latency by op (total)", "Sum of durations over count.",
                     targets((f"sum by (op) (rate(kvcache_request_duration_seconds_sum{{{S}}}[{RI}]))"
                              f" / sum by (op) (rate(kvcache_request_duration_seconds_count{{{S}}}[{RI}]))",
                              "{{op}}")), unit="s"), 12, 8)
    L.add(timeseries("Quantize latency p50 / p99 by codec", "From kvcache_quantize_duration_seconds.",
                     targets((quantile(0.5, "kvcache_quantize_duration_seconds", "codec"), "p50 {{codec}}"),
                             (quantile(0.99, "kvcache_quantize_duration_seconds", "codec"), "p99 {{codec}}")),
                     unit="s"), 12, 8)
    L.add(timeseries("Quantize operations/s by codec", "Quantizations per second.",
                     targets((f"sum by (codec) (rate(kvcache_quantize_duration_seconds_count{{{S}}}[{RI}]))",
                              "{{codec}}")), unit="ops"), 12, 8)

    L.row("Evictions and integrity")
    L.add(timeseries("Evictions/s by reason (total)",
                     "capacity: made room for writes; watermark: background eviction above the high watermark; deleted: removed by clients; data_loss: failed checks.",
                     targets((f"sum by (reason) (rate(kvcache_evictions_total{{{S}}}[{RI}]))", "{{reason}}")),
                     unit="ops"), 12, 8)
    L.add(timeseries("Capacity evictions/s per node", "Capacity and watermark evictions; alert KvcacheEvictionStorm watches these.",
                     targets((f'sum by (instance) (rate(kvcache_evictions_total{{{S},reason=~"capacity|watermark"}}[{RI}]))',
                              "{{instance}}")), unit="ops"), 12, 8)
    L.add(timeseries("Data-loss events per node", "Blocks failing checksum/header checks on read.",
                     targets((f"sum by (instance) (increase(kvcache_data_loss_total{{{S}}}[{RI}]))", "{{instance}}")),
                     thresholds=[(1, "red")]), 12, 8)
    L.add(timeseries("Up and ready per node", "up: scraped; ready: serving (0 while draining).",
                     targets((f"up{{{S}}}", "{{instance}} up"), (f"kvcache_ready{{{S}}}", "{{instance}} ready"))),
          12, 8)
    build_info = {"type": "table", "title": "Build info", "description": "kvcache_build_info per node.",
                  "datasource": DS,
                  "targets": [target(f"kvcache_build_info{{{S}}}", instant=True, fmt="table")],
                  "fieldConfig": {"defaults": {}, "overrides": []},
                  "options": {"showHeader": True},
                  "transformations": [{"id": "organize", "options": {
                      "excludeByName": {"Time": True, "Value": True, "__name__": True}}}]}
    L.add(build_info, 24, 6)

    def query_var(name, label, query, multi, include_all, all_value=None, current=None):
        v = {"type": "query", "name": name, "label": label, "datasource": DS,
             "query": {"query": query, "refId": f"{name}-var"}, "definition": query,
             "refresh": 2, "sort": 1, "multi": multi, "includeAll": include_all, "hide": 0, "options": []}
        if all_value is not None:
            v["allValue"] = all_value
        if current is not None:
            v["current"] = current
        return v

    templating = {"list": [
        {"type": "datasource", "name": "datasource", "label": "Data source", "query": "prometheus",
         "hide": 0, "refresh": 1, "regex": "", "current": {}, "options": []},
        query_var("job", "Job", "label_values(kvcache_build_info, job)", False, False,
                  current={"selected": True, "text": "kvcache", "value": "kvcache"}),
        query_var("instance", "Node", 'label_values(kvcache_build_info{job="$job"}, instance)', True, True,
                  all_value=".*", current={"selected": True, "text": ["All"], "value": ["$__all"]}),
        query_var("kv_namespace", "KV namespace",
                  'label_values(kvcache_token_capacity_remaining{job="$job"}, kv_namespace)', True, True,
                  all_value=".*", current={"selected": True, "text": ["All"], "value": ["$__all"]}),
    ]}

    return {
        "title": "kvcache",
        "uid": "kvcache-overview",
        "description": "Disaggregated KV-cache store: capacity, hit rate, throughput, latency, evictions.",
        "tags": ["kvcache"],
        "editable": True,
        "graphTooltip": 1,
        "schemaVersion": 39,
        "version": 1,
        "refresh": "30s",
        "time": {"from": "now-1h", "to": "now"},
        "timepicker": {},
        "timezone": "",
        "annotations": {"list": []},
        "links": [],
        "templating": templating,
        "panels": L.panels,
    }


def render():
    return json.dumps(build(), indent=2, sort_keys=False) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="fail if the JSON file is not what this script writes")
    args = ap.parse_args()
    text = render()
    if args.check:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"{OUT} is stale: run python3 {pathlib.Path(__file__).as_posix()}", file=sys.stderr)
            return 1
        print(f"{OUT.name} is up to date")
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
