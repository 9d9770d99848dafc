#!/usr/bin/env bash
# The whole GPU suite on a CUDA machine: build the kernels for this GPU, run every `gpu` test, and
# write a result file (pass/fail counts, and the provenance the lab's tools record: command, git
# commit, date, device, versions).
#   tests/gpu/run_suite.sh [RESULT_JSON] [extra pytest args...]
# On any machine with a CUDA GPU and the package installed (`pip install -e '.[test]'`):
#   tests/gpu/run_suite.sh gpu-suite.json
set -euo pipefail
argv=("$0" "$@")  # this script's command line, for the result file
result=${1:-gpu-suite.json}; shift || true
# SUITE_PREBUILD=0 (a run of a few tests, e.g. with -k): no build first, kernels compile on first use
if [ "${SUITE_PREBUILD:-1}" != 0 ]; then
  target=$(python3 -c "import torch; from attn_prologue.variants import arch_for_capability; print(arch_for_capability(*torch.cuda.get_device_capability())[1])")
  python3 -m attn_prologue build --targets "$target" >/dev/null
  configs=$(python3 -c "from tests.gpu.cases import CONFIG_KEYS, CONFIG_VARIANTS as V; print(','.join(CONFIG_KEYS), ' '.join(v.replace('_sm90', '') for v in V))")
  python3 -m attn_prologue build --targets "$target" --config ${configs%% *} --variants ${configs#* } >/dev/null
fi
start=$(date +%s)
set +e
python3 -m pytest tests -m gpu -q -p no:cacheprovider --junitxml "$result.xml" "$@"
rc=$?
set -e
python3 - "$result" "$start" "${argv[@]}" <<'PY'
import json, sys, time, xml.etree.ElementTree as ET
from attn_prologue.lab.provenance import provenance
result, start, argv = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
suite = ET.parse(result + ".xml").getroot()
suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
failed = [tc.get("classname") + "::" + tc.get("name") for tc in suite.iter("testcase") if tc.find("failure") is not None or tc.find("error") is not None]
counts = {k: int(suite.get(k)) for k in ("tests", "failures", "errors", "skipped")}
out = {
    "provenance": provenance(argv=argv),
    **counts, "passed": counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"],
    "seconds": round(time.time() - start, 1), "failed": failed,
}
json.dump(out, open(result, "w"), indent=1)
print(json.dumps({k: v for k, v in out.items() if k != "failed"}, indent=1))
PY
exit $rc
