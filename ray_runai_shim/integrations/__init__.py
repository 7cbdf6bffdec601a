"""Integrations, by what is patched (ddtrace's ``contrib/`` shape).

A function several patches change has one hook, whose code calls their steps in order:
``engine_config`` (vLLM's ``EngineArgs.create_engine_config``: the steps of ``engine_relay``,
``aux_pull``, ``anonymous``, ``vllm_args``) and ``serve_engine_kwargs`` (Serve's
``get_initialization_kwargs``: ``serve``, ``serve_mirror``). The other functions have one
wrapper each: ``ray_data`` (Ray Data's vLLM stage), ``tokenizer`` (tokenizer-only downloads),
``serve`` (Serve LLM's node initialisation), ``offline`` (vLLM's Hub lookup), ``peer_files``
(vLLM's workers on other nodes), ``engine_relay`` (stage size, release once loaded),
``runai_loader`` (each rank reads the relay's copy as it lands). All are named in
:data:`ray_runai_shim.tables.targets.TARGETS` and imported only when their consumer module is.
``decide`` is the one classifier they all ask; ``reader_count`` and ``relay_budget`` serve the
relay's steps. Imports point down: integrations -> snapshot / stores -> tables.
"""
