#!/usr/bin/env bash
# The whole GPU suite on a CUDA machine: build the kernels for this GPU, run every `gpu` test, and
# write a result file (device, date, versions, pass/fail counts, the command).
#   tests/gpu/run_suite.sh [RESULT_JSON] [extra pytest args...]
# On the device machine (see ../shared/device/README.md):
#   source .device/setup.sh && pip install -q --no-deps --no-build-isolation -e . && tests/gpu/run_suite.sh $OUT/gpu-suite.json
set -euo pipefail
result=${1:-gpu-suite.json}; shift || true
target=$(python3 -c "import torch; from attn_prologue import dispatch; print(dispatch.target_for_capability(*torch.cuda.get_device_capability())[1])")
python3 -m attn_prologue build --targets "$target" >/dev/null
configs=$(python3 -c "from tests.gpu.cases import CONFIG_KEYS, CONFIG_VARIANTS as V; print(','.join(CONFIG_KEYS), ' '.join(v.replace('_sm90', '') for v in V))")
python3 -m attn_prologue build --targets "$target" --config ${configs%% *} --variants ${configs#* } >/dev/null
start=$(date +%s)
set +e
python3 -m pytest tests -m gpu -q -p no:cacheprovider --junitxml "$result.xml" "$@"
rc=$?
set -e
python3 - "$result" "$start" "$rc" "$*" <<'PY'
import json, platform, sys, time, datetime, xml.etree.ElementTree as ET
import torch
from attn_prologue.jit import compiler
result, start, rc, extra = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
suite = ET.parse(result + ".xml").getroot()
suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
failed = [tc.get("classname") + "::" + tc.get("name") for tc in suite.iter("testcase") if tc.find("failure") is not None or tc.find("error") is not None]
out = {
    "device": torch.cuda.get_device_name(), "capability": list(torch.cuda.get_device_capability()),
    "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    "torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
    "dsl": compiler.dsl_versions(),
    "command": "tests/gpu/run_suite.sh " + extra,
    "tests": int(suite.get("tests")), "failures": int(suite.get("failures")), "errors": int(suite.get("errors")),
    "skipped": int(suite.get("skipped")), "passed": int(suite.get("tests")) - int(suite.get("failures")) - int(suite.get("errors")) - int(suite.get("skipped")),
    "seconds": round(time.time() - start, 1), "failed": failed,
}
json.dump(out, open(result, "w"), indent=1)
print(json.dumps({k: v for k, v in out.items() if k != "failed"}, indent=1))
PY
exit $rc
