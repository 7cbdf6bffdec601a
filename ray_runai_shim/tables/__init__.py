"""The data tables everything else is generated from: every patched name (``targets``),
what each Ray release needs (``support``), the shim's own settings (``settings``).
Stdlib only; nothing here imports another part of the shim but these tables."""
