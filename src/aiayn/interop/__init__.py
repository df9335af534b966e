"""Models to and from other inference engines: export to CTranslate2 (docs/interop.md)."""
