from sglang.srt.models.deepseek_v2 import EntryClass  # noqa: F401
