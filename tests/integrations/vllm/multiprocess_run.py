"""One vLLM run in its default multi-process mode (front end, engine core, worker), for
test_vllm_multiprocess: prints `TOKENS <json>` and, when a metrics port is given, `SCRAPE <json>` (the
worker's /metrics, read before vLLM shuts down). argv: canary|fault|off [metrics_port]."""
from __future__ import annotations

import json
import os
import sys
import urllib.request

os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
for k, v in {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}.items():
    os.environ.setdefault(k, v)


def main() -> None:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    from kv_canary.demo import vllm as dv

    what = sys.argv[1]
    port = int(sys.argv[2]) if len(sys.argv) > 2 else None
    canary = dv.transfer_config(mode="log", backend="torch", sweep_interval=dv.SWEEP, metrics_port=port)
    config = {"off": None, "canary": canary,
              "fault": {"kv_connector": "MultiConnector", "kv_role": "kv_both", "kv_connector_extra_config": {
                  "connectors": [canary, {"kv_connector": "FaultConnector", "kv_role": "kv_both",
                                          "kv_connector_module_path": "fault_connector",
                                          "kv_connector_extra_config": {"at": 5}}]}}}[what]
    w = dv.Workload(waves=1)
    llm = LLM(model=dv.model_dir(), kv_transfer_config=KVTransferConfig(**config) if config else None,
              **w.llm_kwargs())
    params = SamplingParams(max_tokens=w.max_new_tokens, temperature=0, ignore_eos=True)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in w.prompts()], params, use_tqdm=False)
    print("TOKENS " + json.dumps([list(o.outputs[0].token_ids) for o in outs]), flush=True)
    if port is not None:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        print("SCRAPE " + json.dumps(text), flush=True)
    llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    main()
