"""Loading base models: architectures, sharded checkpoints, dtypes, tied embeddings, errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from loraplane.dataplane.attention import AttentionMetadata, query_positions
from loraplane.dataplane.lora import LoRABatch
from loraplane.dataplane.models import (
    SUPPORTED_ARCHITECTURES,
    LlamaForCausalLM,
    UnsupportedModelError,
    load_model,
)
from tests.dataplane.conftest import Family


def _copy_with_config(src: Path, dest: Path, **changes: object) -> Path:
    shutil.copytree(src, dest)
    config = json.loads((dest / "config.json").read_text())
    config.update(changes)
    (dest / "config.json").write_text(json.dumps(config))
    return dest


def _logits(model: LlamaForCausalLM, tokens: list[int]) -> torch.Tensor:
    n = len(tokens)
    model.allocate_kv_cache(8, 4)
    attn = AttentionMetadata.build([n], [n], [[5, 0, 3, 6, 1][: -(-n // 4)]], 4)
    return model.compute_logits(model(torch.tensor(tokens), query_positions([n], [n]), attn))


def test_unknown_model_type_fails_with_a_message_listing_supported_architectures(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    model_dir = _copy_with_config(tiny_llama_dir, tmp_path / "gpt2", model_type="gpt2")
    with pytest.raises(UnsupportedModelError) as err:
        load_model(model_dir, torch.float32, torch.device("cpu"))
    for name in ("gpt2", *SUPPORTED_ARCHITECTURES):
        assert name in str(err.value)


def test_unimplemented_rope_scaling_is_refused_rather_than_computed_wrongly(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    model_dir = _copy_with_config(
        tiny_llama_dir,
        tmp_path / "proportional",
        rope_parameters={"rope_type": "proportional", "factor": 4.0, "rope_theta": 10000.0},
    )
    with pytest.raises(UnsupportedModelError, match="proportional"):
        load_model(model_dir, torch.float32, torch.device("cpu"))


def test_sharded_checkpoint_with_index_loads_the_same_weights_as_one_file(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    sharded = tmp_path / "sharded"
    hf.save_pretrained(sharded, max_shard_size="40KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 2
    one = load_model(tiny_llama_dir, torch.float32, torch.device("cpu"))
    many = load_model(sharded, torch.float32, torch.device("cpu"))
    for (name, a), (_, b) in zip(
        sorted(one.state_dict().items()), sorted(many.state_dict().items()), strict=True
    ):
        assert torch.equal(a, b), name


def test_missing_weights_fail_with_the_missing_names(tiny_llama_dir: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken"
    shutil.copytree(tiny_llama_dir, broken)
    state = load_file(str(broken / "model.safetensors"))
    del state["model.norm.weight"]
    save_file(state, str(broken / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model\.norm\.weight"):
        load_model(broken, torch.float32, torch.device("cpu"))


def test_qwen2_tied_embeddings_share_one_matrix_with_the_output_projection(
    families: dict[str, Family],
) -> None:
    model = load_model(families["qwen2"].model_dir, torch.float32, torch.device("cpu"))
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert model.model.decoder_layers[0].self_attn.q_proj.bias is not None


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_model_runs_close_to_fp32(tiny_llama_dir: Path, dtype: torch.dtype) -> None:
    tokens = [5, 17, 99, 3, 250, 41, 7]
    full = _logits(load_model(tiny_llama_dir, torch.float32, torch.device("cpu")), tokens)
    half_model = load_model(tiny_llama_dir, dtype, torch.device("cpu"))
    assert half_model.lm_head.weight.dtype == dtype
    half = _logits(half_model, tokens)
    assert half.dtype == torch.float32  # logits are always fp32
    torch.testing.assert_close(half, full, atol=0.05, rtol=0.05)


def test_unsupported_dtype_is_rejected(tiny_llama_dir: Path) -> None:
    with pytest.raises(ValueError, match="dtype"):
        load_model(tiny_llama_dir, torch.float64, torch.device("cpu"))


def test_forward_before_the_kv_cache_is_allocated_fails_clearly(tiny_llama_dir: Path) -> None:
    model = load_model(tiny_llama_dir, torch.float32, torch.device("cpu"))
    attn = AttentionMetadata.build([2], [2], [[0]], 4)
    with pytest.raises(RuntimeError, match="allocate_kv_cache"):
        model(torch.tensor([4, 5]), torch.tensor([0, 1]), attn)


def test_lora_batch_without_installed_lora_layers_is_rejected(tiny_llama_dir: Path) -> None:
    model = load_model(tiny_llama_dir, torch.float32, torch.device("cpu"))
    model.allocate_kv_cache(2, 4)
    attn = AttentionMetadata.build([2], [2], [[0]], 4)
    with pytest.raises(ValueError, match="install_lora"):
        model(torch.tensor([4, 5]), torch.tensor([0, 1]), attn, LoRABatch.from_token_slots([0, 0]))


def test_token_count_mismatch_between_inputs_and_metadata_is_rejected(
    tiny_llama_dir: Path,
) -> None:
    model = load_model(tiny_llama_dir, torch.float32, torch.device("cpu"))
    model.allocate_kv_cache(2, 4)
    attn = AttentionMetadata.build([3], [3], [[0]], 4)
    with pytest.raises(ValueError, match="attn covers 3 tokens"):
        model(torch.tensor([4, 5]), torch.tensor([0, 1]), attn)


def test_kv_cache_block_bytes_counts_k_and_v_of_every_layer(tiny_llama_dir: Path) -> None:
    model = load_model(tiny_llama_dir, torch.bfloat16, torch.device("cpu"))
    model.allocate_kv_cache(num_blocks=3, block_size=4)
    assert model.kv_cache is not None
    assert model.kv_cache.nbytes == 3 * model.kv_cache_block_bytes(4)
    k_cache = model.model.decoder_layers[1].self_attn.k_cache
    assert k_cache is not None
    assert k_cache.shape == (3, 4, 2, 16)  # [num_blocks, block_size, kv_heads, head_dim]


_PEAK_SCRIPT = """
import sys, threading, time
import torch
from loraplane.dataplane.models.llama import LlamaForCausalLM
from loraplane.dataplane.models.loader import load_model, read_config

def anon():
    with open('/proc/self/status') as f:
        for line in f:
            if line.startswith('RssAnon:'):
                return int(line.split()[1]) * 1024
    raise SystemExit('no RssAnon')

with torch.device('meta'):  # torch's one-off set-up for this model costs memory of its own
    LlamaForCausalLM(read_config(sys.argv[1]))
base = anon()
peak = [base]
done = threading.Event()

def watch():
    while not done.is_set():
        peak[0] = max(peak[0], anon())
        time.sleep(0.002)

watcher = threading.Thread(target=watch)
watcher.start()
model = load_model(sys.argv[1], torch.bfloat16, 'cpu')
done.set()
watcher.join()
print(peak[0] - base)
"""


def test_loading_a_full_precision_checkpoint_in_bf16_never_holds_it_in_host_memory(
    tmp_path: Path,
) -> None:
    """Peak anonymous memory of a load, measured in a fresh process: an fp32 checkpoint cast
    to bf16 costs the bf16 model plus about one tensor, never the fp32 shard (which reading
    shard by shard would hold, 1.5x the checkpoint's bytes here)."""
    import subprocess
    import sys

    from loraplane.demo.build import build_llama

    shape = {"hidden_size": 512, "num_hidden_layers": 8, "num_attention_heads": 8,
             "num_key_value_heads": 4, "intermediate_size": 2048, "vocab_size": 8000}  # fmt: skip
    model_dir = build_llama(tmp_path / "fp32", **shape)
    checkpoint = sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))
    bf16_model = checkpoint // 2
    largest_fp32_tensor = 8000 * 512 * 4
    out = subprocess.run(
        [sys.executable, "-c", _PEAK_SCRIPT, str(model_dir)], capture_output=True, text=True,
        check=True, cwd=Path(__file__).parents[2],
    )  # fmt: skip
    peak = int(out.stdout.split()[-1])
    assert peak < bf16_model + largest_fp32_tensor + (24 << 20), (peak, checkpoint)


def test_a_load_leaves_torch_dynamo_unimported_and_a_model_built_off_meta_is_drawn(
    tiny_llama_dir: Path,
) -> None:
    """The loader builds the decoder on the meta device; torch's own embedding init there
    would import torch._dynamo (2-4 s of each engine's start). In a fresh process: the load
    imports no torch._dynamo and gives the checkpoint's embedding; a model built on the CPU
    still draws its embedding as nn.Embedding does."""
    import subprocess
    import sys

    script = (
        "import sys, torch\n"
        "from loraplane.dataplane.models.loader import load_model\n"
        "from loraplane.dataplane.models.llama import token_embedding\n"
        "model = load_model(sys.argv[1], torch.float32, 'cpu')\n"
        "print('dynamo', 'torch._dynamo' in sys.modules)\n"
        "torch.manual_seed(0); ours = token_embedding(50, 8).weight\n"
        "torch.manual_seed(0); torchs = torch.nn.Embedding(50, 8).weight\n"
        "print('drawn', torch.equal(ours, torchs))\n"
        "from safetensors.torch import load_file\n"
        "want = load_file(sys.argv[1] + '/model.safetensors')['model.embed_tokens.weight']\n"
        "print('loaded', torch.equal(model.model.embed_tokens.weight, want.float()))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script, str(tiny_llama_dir)], capture_output=True, text=True,
        check=True, cwd=Path(__file__).parents[2],
    ).stdout.split()  # fmt: skip
    assert out == ["dynamo", "False", "drawn", "True", "loaded", "True"], out


def test_cpu_weights_are_copied_out_of_the_checkpoints_mapping(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    """safetensors hands out views of the file's mapping; a CPU model keeps none of them
    (loader._owned: the native CPU linear reads its own copies faster), so the file is no
    longer mapped once the model is loaded, and the model computes as before."""
    model_dir = shutil.copytree(tiny_llama_dir, tmp_path / "model")  # a path of this test's own
    files = [str(p.resolve()) for p in model_dir.glob("*.safetensors")]
    model = load_model(model_dir, torch.float32, torch.device("cpu"))
    maps = Path("/proc/self/maps").read_text()
    assert files and not any(f in maps for f in files)
    reference = load_model(tiny_llama_dir, torch.float32, torch.device("cpu"))
    assert torch.equal(_logits(model, [1, 2, 3]), _logits(reference, [1, 2, 3]))
