"""What the fork server of :mod:`lightning_shard.demos.ranks` imports before it forks any rank, besides torch,
Lightning and the package: the optional libraries a rank would otherwise import on its first use of them, in
every rank of every job (DeepSpeed's engine and the inductor modules its optimizers' ``torch.compile`` loads,
about 4 s per rank on a 2-core machine; the Hugging Face model classes the tests train; torchao; torchft). Only
third-party modules: the package's own are in the server's list itself.

Each import is best-effort: a library that is missing, or fails to import here, is imported (or fails) in the
rank as before. None of them starts a thread at import, so forking the server stays safe.

Last, every object these imports made is moved out of the garbage collector's view (``gc.freeze``, as the
``gc`` docs advise before forking workers): a rank's full collections (DeepSpeed runs one per ZeRO-3 set-up)
then scan only what the rank made, and the pages the modules sit on are not written by the collector.
"""

from __future__ import annotations

import gc
import importlib

#: Imported in this order; a failure skips that module only.
OPTIONAL = (
    "torch._inductor.compile_fx",
    "deepspeed",
    "deepspeed.runtime.engine",
    "deepspeed.runtime.zero.stage3",
    "deepspeed.runtime.zero.stage_1_and_2",
    "deepspeed.runtime.zero.muon.muon_optimizer",
    "transformers.models.llama.modeling_llama",
    "transformers.models.qwen2.modeling_qwen2",
    "transformers.models.qwen3_moe.modeling_qwen3_moe",
    "transformers.models.gpt2.modeling_gpt2",
    "torchao.float8",
    "torchft",
)

for _name in OPTIONAL:
    try:
        importlib.import_module(_name)
    except Exception:  # noqa: BLE001, S112 - best-effort: the rank imports it (or reports it) itself
        continue

gc.freeze()
