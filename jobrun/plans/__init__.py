"""Plan language: YAML -> IR, analyzer, printer (never imports torch)."""
