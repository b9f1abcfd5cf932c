"""policyc backends: one plan (precision_dsl.plan.Plan) emitted as consistent artifacts for every consumer of an RL
loop. Each module expresses the plan exactly or raises `common.UnsupportedByBackend(backend, tensor, capability)`.

  megatron       trainer flags, TE per-module precision YAML (per PP stage when layer-specific), NVTE env
  sglang         rollout server args/env and the checkpoint quantization_config (SGLang exemption rules)
  converter      HF safetensors -> quantized checkpoint (streaming, atomic, resumable) + verify
  weight_update  live trainer -> rollout update (same bytes as the converter), transports, buckets
  quantize       the one quantize-a-tensor function the converter and the weight update share
  cli            `policyc emit / convert / verify` (imports only typer at start-up)

Nothing is imported here so that `import precision_dsl.backends.cli` stays cheap.
"""
