"""Engine versions: which release of TransformerEngine / megatron-core / SGLang first has each capability a plan can
need, so every artifact declares a TRUE minimum and `--te-version` refuses an older engine by capability name
instead of letting it silently run something else (an unknown NVTE_* variable is simply ignored by TE).

Each entry was read in the engines' published sources (tests/test_te_versions.py re-checks the TE ones against the
`transformer-engine` wheels of the version itself and of the release before it):

  TE 2.14  NVFP4 block scale a_b x RN(S_enc x RN(1/6)), the formula policyc's reference matches (2.13 rounded
           a_b / 6 first): pytorch/custom_recipes/quantization_nvfp4.py `_quantize_blockwise_reference`
  TE 2.15  NVTE_BACKWARD_OVERRIDE (common/recipe/__init__.py: os.getenv("NVTE_BACKWARD_OVERRIDE"))
  TE 2.16  NVTE_NVFP4_ROW_SCALED_ACTIVATION (per-token NVFP4 activation scales)
  TE 2.17  NVTE_NVFP4_4OVER6
  TE 2.18  `dequantized` backward drops the saved high-precision input also for modules megatron-core marks
           save_original_input (pytorch/module/linear.py, grouped_linear.py: `elif backward_override ==
           "dequantized": save_original_input = False`); in 2.17 those modules' wgrad used the BF16 input
  megatron-core 0.16.0  per-module TE precision config (--te-precision-config-file, TEQuantizationParams);
           absent in core_v0.15.3. policyc's oracle runs 0.16.1 (installed) and 0.19.2 (the newest release, from its
           wheel in another process: tests/test_megatron_oracle.py test_newer_megatron_core_agrees), and both run
           every module of every accepted cell as the plan says, so the open range `megatron-core>=0.16.0` in the
           Megatron artifact headers is verified up to VERIFIED["megatron-core"][-1]
  SGLang 0.5.23  the version whose source the SGLang oracle reads (no older release is verified)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional

TESTED = {"transformer-engine": "2.20.2", "megatron-core": "0.16.1", "sglang": "0.5.23"}
# Every release an oracle judged the emitted artifacts with (oldest first); TESTED is the one installed for tests.
VERIFIED = {"megatron-core": ("0.16.1", "0.19.2")}

# capability -> (engine, first version that has it)
CAPABILITIES: dict[str, tuple[str, str]] = {
    "te.fp8_block_fp32_scales": ("transformer-engine", "2.13.0"),  # NVTE_FP8_BLOCK_SCALING_FP32_SCALES (<= 2.13)
    "te.nvfp4_formula": ("transformer-engine", "2.14.0"),
    "te.backward_override": ("transformer-engine", "2.15.0"),
    "te.nvfp4_row_scaled_activation": ("transformer-engine", "2.16.0"),
    "te.nvfp4_4over6": ("transformer-engine", "2.17.0"),
    "te.dequantized_drops_saved_input": ("transformer-engine", "2.18.0"),
    "mcore.te_precision_config": ("megatron-core", "0.16.0"),
    "sglang.read": ("sglang", "0.5.23"),
}
BASELINE = {"transformer-engine": "2.13.0", "megatron-core": "0.16.0", "sglang": "0.5.23"}

# The NVTE_* variable each TE capability is set through (the TE oracle checks it is read by that version)
ENV_CAPABILITY = {
    "NVTE_FP8_BLOCK_SCALING_FP32_SCALES": "te.fp8_block_fp32_scales",
    "NVTE_NVFP4_DISABLE_RHT": "te.nvfp4_formula",
    "NVTE_NVFP4_DISABLE_STOCHASTIC_ROUNDING": "te.nvfp4_formula",
    "NVTE_NVFP4_DISABLE_2D_QUANTIZATION": "te.nvfp4_formula",
    "NVTE_BACKWARD_OVERRIDE": "te.backward_override",
    "NVTE_NVFP4_ROW_SCALED_ACTIVATION": "te.nvfp4_row_scaled_activation",
    "NVTE_NVFP4_4OVER6": "te.nvfp4_4over6",
}

DESCRIPTION = {
    "te.fp8_block_fp32_scales": "FP8-block fp32 scales (NVTE_FP8_BLOCK_SCALING_FP32_SCALES)",
    "te.nvfp4_formula": "the NVFP4 scale formula policyc's reference and the checkpoint use",
    "te.backward_override": "high-precision / dequantized backward (NVTE_BACKWARD_OVERRIDE)",
    "te.nvfp4_row_scaled_activation": "per-token NVFP4 activation scales (NVTE_NVFP4_ROW_SCALED_ACTIVATION)",
    "te.nvfp4_4over6": "NVFP4 4over6 block selection (NVTE_NVFP4_4OVER6)",
    "te.dequantized_drops_saved_input": "`dequantized` backward that also drops the saved BF16 input of modules "
                                        "megatron-core marks save_original_input",
    "mcore.te_precision_config": "per-module TE precision config (--te-precision-config-file)",
    "sglang.read": "the SGLang reading policyc's oracle verifies",
}


def parse_version(v: str) -> tuple[int, ...]:
    """'2.17.0' / '2.17' / '2.18.0.dev0+abc' -> (2, 17, 0); raises ValueError on anything else."""
    core = v.strip().split("+")[0]
    parts = []
    for p in core.split("."):
        digits = "".join(ch for ch in p if ch.isdigit()) if p[:1].isdigit() else ""
        if not digits:
            break
        parts.append(int(digits))
    if not parts:
        raise ValueError(f"cannot read version '{v}'")
    while len(parts) < 3:
        parts.append(0)
    return tuple(parts[:3])


@dataclass(frozen=True)
class Requirement:
    engine: str
    version: str
    capability: str  # key of CAPABILITIES

    @property
    def text(self) -> str:
        return f"{self.engine} >= {self.version}: {DESCRIPTION.get(self.capability, self.capability)}"


def requirement(capability: str) -> Requirement:
    engine, version = CAPABILITIES[capability]
    return Requirement(engine, version, capability)


def minimum(reqs: Iterable[Requirement], engine: str) -> str:
    """The declared minimum of `engine`: the newest version any needed capability requires (baseline otherwise)."""
    best = BASELINE[engine]
    for r in reqs:
        if r.engine == engine and parse_version(r.version) > parse_version(best):
            best = r.version
    return best


def missing(reqs: Iterable[Requirement], engine: str, have: Optional[str]) -> list[Requirement]:
    """The requirements an installed `engine` version `have` does not meet (none when `have` is None)."""
    if have is None:
        return []
    hv = parse_version(have)
    return sorted({r for r in reqs if r.engine == engine and parse_version(r.version) > hv},
                  key=lambda r: (parse_version(r.version), r.capability))


def header(reqs: Iterable[Requirement]) -> str:
    """'megatron-core>=0.16.0, transformer-engine>=2.18.0 (needs: ...)' for artifact headers."""
    reqs = list(reqs)
    parts = [f"{e}>={minimum(reqs, e)}" for e in ("megatron-core", "transformer-engine")]
    needs = sorted({r.capability for r in reqs if r.engine == "transformer-engine"},
                   key=lambda c: parse_version(CAPABILITIES[c][1]))
    return ", ".join(parts) + (f" (TE capabilities: {', '.join(needs)})" if needs else "")
