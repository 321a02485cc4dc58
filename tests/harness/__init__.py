"""What the tests share that is not a fixture: process harnesses and helper modules.

Fixtures stay in conftest.py files; everything a test imports comes from here (`from harness.world import
spawn_ranks`), never `from conftest`. tests/ is on sys.path (pytest puts the directory of tests/conftest.py
there), so `harness` imports as a top-level package in the test process and in every rank it starts.

- procs: free loopback ports and the fork-server start method the multi-process tests use
- world: spawn N ranks that each report once through a queue (was tests/harness/world.py)
- outer: a small gloo world for the outer-strategy tests (was tests/harness/outer.py)
- elastic: `islands run --elastic` / `islands join` jobs as processes, gates and records (was tests/harness/elastic.py)
- cli: the CLI in this process, the tiny byte-LM config, resume and exact comparison (was tests/harness/cli.py)
- hf: a tiny hf-causal-lm job on N forked gloo ranks (was tests/harness/hf.py)
- dict_store, legacy_blobs, legacy_containers, lm_reference, browser: helper modules
"""
