"""`swift infer`'s other backends, which do not install here (vLLM, SGLang, LMDeploy need CUDA):
ms-swift's own ``SwiftInfer._batch_infer`` and ``InferEngine`` machinery over the scenario's
rows, protected, with each engine stubbed at the request boundary only. Each stub encodes a
request exactly where and how its engine does (ms-swift 4.6.0's code: the async engines'
``infer_async`` runs ``template.encode`` on the event loop's executor, one task per request
under ``InferEngine._batch_infer_stream``; vLLM's synchronous ``infer`` runs
``InferEngine._batch_encode`` over the batch and ``_add_error_list``), with the real template
and its real loaders; only the model's answer is made up.

    python -m tests.stub_engines MODEL_DIR DATASET     # prints {backend: [record, ...]} as JSON
"""

from __future__ import annotations

import asyncio
import json
import sys


def _answer(inputs):
    from swift.infer_engine.protocol import ChatCompletionResponse, ChatCompletionResponseChoice, ChatMessage, UsageInfo

    message = ChatMessage(role="assistant", content=f"{len(inputs['input_ids'])} prompt tokens")
    return ChatCompletionResponse(model="stub", choices=[ChatCompletionResponseChoice(0, message, "stop")],
                                  usage=UsageInfo(0, 0, 0))


def _engines(template):
    from swift.infer_engine import InferEngine

    class AsyncEngineStub(InferEngine):
        """SGLang's, LMDeploy's and vLLM's async engine up to the model."""

        def __init__(self, template, mode):
            super().__init__(template)
            self.mode = mode

        async def infer_async(self, infer_request, request_config=None, **kwargs):
            self.template.set_mode(self.mode)
            loop = asyncio.get_running_loop()
            inputs = await loop.run_in_executor(None, self.template.encode, infer_request, True)
            return _answer(inputs)

    class VllmEngineStub(AsyncEngineStub):
        """vLLM's engine (`swift infer --infer_backend vllm`, not async) up to the model."""

        def infer(self, infer_requests, request_config=None, metrics=None, *, use_tqdm=None, **kwargs):
            self.template.set_mode("vllm")
            batched, errors = self._batch_encode(infer_requests, strict=getattr(self, "strict", True))
            return self._add_error_list([_answer(inputs) for inputs in batched], errors)

    return {"vllm": VllmEngineStub(template, "vllm"), "vllm_async": AsyncEngineStub(template, "vllm"),
            "sglang": AsyncEngineStub(template, "sglang"), "lmdeploy": AsyncEngineStub(template, "lmdeploy")}


def main(model_dir: str, dataset: str) -> dict:
    import types

    import swift_safe_media
    from swift_safe_media.hosts.swift import inference as swift_inference

    swift_safe_media.enable(hosts=["swift"], timeout=5)
    swift_inference.MODE.name = "infer"  # what parse_args chooses for InferArguments
    from swift.dataset import load_dataset
    from swift.infer_engine import RequestConfig
    from swift.model import get_processor
    from swift.pipelines.infer.infer import SwiftInfer
    from swift.template import get_template

    template = get_template(get_processor(model_dir, model_type="qwen2_5_omni"), template_type="qwen2_5_omni")
    _, rows = load_dataset([dataset], split_dataset_ratio=1.0, shuffle=False)
    results = {}
    for backend, engine in _engines(template).items():
        pipeline = SwiftInfer.__new__(SwiftInfer)
        vars(pipeline).update(infer_engine=engine, infer_kwargs={}, args=types.SimpleNamespace(
            infer_backend=backend.split("_")[0], rank=-1, global_world_size=1, task_type="causal_lm",
            vllm_tensor_parallel_size=1))
        results[backend] = pipeline._batch_infer(rows, RequestConfig(max_tokens=4))
    return results


if __name__ == "__main__":
    print("RESULTS " + json.dumps(main(*sys.argv[1:3]), default=str))
