"""Model package handed to SGLang through its own `SGLANG_EXTERNAL_MODEL_PACKAGE` hook (models/registry.py): the
registry then registers only these SGLang model modules instead of importing all ~300 (minutes on 2 cores).
Each module re-exports an SGLang module's `EntryClass`; no model code lives here."""
