#!/usr/bin/env python3
"""Lint and render a Helm chart with Helm's own Go code (helm-python-sdk embeds Helm v4).

Usage: render-chart.py CHART_DIR [VALUES_JSON]
Prints one JSON document: {"lint": <helm lint report>, "objects": [<rendered objects>], "crds": [<objects of the
chart's crds/, as Helm loads them: installed, never templated>], "error": <str or null>}.
A template `fail` or a schema violation is reported in "error" (exit 0), so callers can assert on it.
"""
import json
import sys

import helm_python as helm
import yaml


def main() -> int:
    if len(sys.argv) not in (2, 3):
        print(__doc__, file=sys.stderr)
        return 2
    chart_dir = sys.argv[1]
    values = json.loads(sys.argv[2]) if len(sys.argv) == 3 else None
    lint = helm.lint(chart_dir, values, strict=True, kube_version="v1.33.0")
    out = {"lint": lint, "objects": [], "crds": [], "error": None}
    try:
        with helm.Chart.load(chart_dir) as chart:
            chart.validate_schema(values)
            out["crds"] = [doc for crd in chart.crds for doc in yaml.safe_load_all(crd["data"]) if doc]
            manifests = chart.render(values, name="aether", namespace="aether-system", is_install=True)
    except helm.HelmError as e:
        out["error"] = str(e)
    else:
        for path in sorted(manifests):
            if not path.endswith((".yaml", ".yml")):
                continue
            for doc in yaml.safe_load_all(manifests[path]):
                if doc:
                    out["objects"].append({"template": path, "object": doc})
    json.dump(out, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
