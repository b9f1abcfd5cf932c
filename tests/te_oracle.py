"""Oracle: TransformerEngine's own Python sources, per release, from the `transformer-engine` wheel on PyPI
(py3-none-any, ~1 MB: the pure-Python package; the CUDA libraries live in transformer-engine-cu12/-torch).

`wheel(version)` downloads once with `pip download --no-deps` into $POLICYC_ORACLE_CACHE (default
~/.cache/policyc-oracles)/te and reads the sources straight from the zip (nothing is installed or imported).
A download/read failure raises OracleUnavailable with the reason (tests fail with it; they never skip).
"""

from __future__ import annotations

import functools
import re
import zipfile
from pathlib import Path

from oracles._wheels import cache_dir, download

NEWEST = "2.20.2"
RELEASES = ["2.13.0", "2.14.0", "2.15.0", "2.16.0", "2.17.0", "2.18.0", NEWEST]


class OracleUnavailable(RuntimeError):
    pass


def wheel(version: str) -> Path:
    return download(f"transformer-engine=={version}", OracleUnavailable, dest=cache_dir() / "te", timeout=600)


@functools.lru_cache(maxsize=None)
def sources(version: str) -> dict[str, str]:
    """{path inside the wheel: text} for every .py file of TE `version`."""
    try:
        with zipfile.ZipFile(wheel(version)) as z:
            return {n: z.read(n).decode("utf-8", "replace") for n in z.namelist() if n.endswith(".py")}
    except zipfile.BadZipFile as err:
        raise OracleUnavailable(f"transformer-engine {version} wheel is unreadable: {err}") from err


def reads_env(version: str, var: str) -> list[str]:
    """Files of TE `version` that READ environment variable `var` (os.getenv / os.environ.get / os.environ[...])."""
    pat = re.compile(r"os\.(?:getenv|environ\.get)\(\s*['\"]" + re.escape(var) + r"['\"]"
                     r"|os\.environ\[\s*['\"]" + re.escape(var) + r"['\"]\s*\]")
    return sorted(p for p, text in sources(version).items() if pat.search(text))


# Capabilities that are not a variable of their own: a source pattern that shows the behaviour.
# (file path regex, pattern); the file is looked up by a path regex because TE moves its reference quantizers between releases
# (custom_recipes/ in 2.14, elsewhere from 2.16: the wheels in ~/.cache/policyc-oracles/te).
BEHAVIOUR = {
    # 2.14: NVFP4 block scale a_b x RN(S_enc * RN(1/6)) in the Python reference (TE <= 2.13: RN(RN(a_b / 6) x S_enc))
    "te.nvfp4_formula": (r"custom_recipes/\w*nvfp4\.py",
                         r"global_encode_scale\s*\*\s*torch\.reciprocal\(FLOAT4_E2M1_MAX\)"),
    # 2.18: `dequantized` backward does not keep the saved high-precision input (linear.py; grouped_linear.py too)
    "te.dequantized_drops_saved_input": (r"pytorch/module/linear\.py",
                                         r"elif backward_override == \"dequantized\":\s*\n\s*save_original_input"
                                         r" = False"),
}


def has_behaviour(version: str, capability: str) -> bool:
    name, pattern = BEHAVIOUR[capability]
    texts = [t for p, t in sources(version).items() if re.search(name + "$", p)]
    if not texts:
        raise OracleUnavailable(f"transformer-engine {version} has no {name}")
    return any(re.search(pattern, t) for t in texts)
