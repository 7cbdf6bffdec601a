"""Integrations: one module per consumer the shim patches (ddtrace's ``contrib/`` shape).

``ray_data`` (Ray Data's vLLM stage), ``tokenizer`` (tokenizer-only downloads),
``serve`` / ``serve_mirror`` (Serve LLM), ``vllm_args`` / ``aux_pull`` / ``anonymous`` / ``offline``
(vLLM's ``EngineArgs``), ``peer_files`` (vLLM's workers on other nodes). Each is a
set of wrappers named in :data:`ray_runai_shim.tables.targets.TARGETS`, imported only
when its consumer module is. ``decide`` is the one classifier they all ask.
Imports point down: integrations -> snapshot / stores -> tables.
"""
