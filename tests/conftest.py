"""Test-wide setup: CPU only, Triton in interpreter mode, quiet logs, helpers shared by tests."""

from __future__ import annotations

import contextlib
import os

# Triton has no CPU backend; its interpreter must be enabled before triton is first imported.
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The suite is a package (``tests/<concern>/test_*.py``) whose modules import helpers as ``tests.*``: pytest puts the
# repository root on its own path; the scripts the tests launch (ranks, ``python tests/.../x.py`` runs) get it here.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.environ["PYTHONPATH"] = os.pathsep.join(
    dict.fromkeys(filter(None, [_ROOT, *os.environ.get("PYTHONPATH", "").split(os.pathsep)])))

# One intra-op thread per test process: the tests' tensors are tiny, and a second OpenMP thread mostly spin-waits at
# each op's barrier, more so beside other work on the cores. Under pytest-xdist (`make test`: two workers on the CI's
# two cores) two workers of two threads each spin-wait on each other; `make test-fast` (one process) took 354 s of CPU
# and 366 s with two threads, 226 s of CPU and 311 s beside a load of 4.5 with one. Launched ranks take one already.
os.environ["OMP_NUM_THREADS"] = "1"

from collections.abc import Callable, Iterator  # noqa: E402
from typing import TYPE_CHECKING  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from tests import no_launch  # noqa: E402
from tests.built_once import BuiltOnce, shared_root  # noqa: E402

if TYPE_CHECKING:
    import torch

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(os.environ.get("LIGHTNING_LLM_SHARED_DATA", REPO.parent / "shared" / "data"))
"""The real data (``../shared/data`` beside the repository, as benchmarks/prepare.py reads it, or
``$LIGHTNING_LLM_SHARED_DATA``, for a checkout elsewhere); tests that need it skip without it."""


def pytest_configure(config: pytest.Config) -> None:
    import torch  # may be imported already (plugins): its pool set here too

    torch.set_num_threads(1)


HEAVY_FIRST = (
    "parallel/test_context_parallel.py", "tasks/test_ppo.py", "cli/test_config_headers.py", "parallel/test_zero.py",
    "models/test_families_layouts.py", "checkpoints/test_reliability.py", "parallel/test_moe_layouts.py",
    "tasks/test_grpo.py", "speed/test_gpu_bench.py", "tasks/test_dpo.py", "parallel/test_trainer_flags.py",
    "generation/test_eval.py", "kernels/test_compile.py",
)
"""The files that took longest (2-7 min of a worker each, `make test` on 2 cores), run first: two workers taking whole
files finish together when the short files come last (in collection order, one of these left a worker alone for
minutes at the end). Only an order: a file missing here runs in its place. Last measured under make test: context
parallel 357 s, PPO 320, the config headers 402, ZeRO and the families' layouts 175 each, the GPU smoke run 233; since
then, on one worker of an idle machine, the config headers 149 -> 79 s, test_reliability 58 -> 47, the GPU smoke run
83 -> 43 (the others' changes not measured here: take the next make test's --durations)."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(HEAVY_FIRST)}
    tests = Path(__file__).resolve().parent

    def key(item: pytest.Item) -> int:
        return rank.get(Path(item.path).resolve().relative_to(tests).as_posix(), len(rank))

    items.sort(key=key)  # stable: the other files, and each file's tests, keep their order


@pytest.fixture(scope="session", autouse=True)
def _no_launch_without_multiprocess(request: pytest.FixtureRequest) -> Iterator[None]:
    """Under ``-m "not multiprocess"`` (``make test-fast``) a test that starts a process fails, naming itself and the
    command (:mod:`tests.no_launch`): the fast loop stays free of launches. Installed where tests run (never in
    pytest-xdist's controller, which starts the workers)."""
    with no_launch.refusing() if no_launch.refused(request.config.getoption("markexpr")) else contextlib.nullcontext():
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    """A test whose launch was refused fails even where it caught the failure (``except BaseException``)."""
    outcome = yield
    report = outcome.get_result()
    if no_launch.refusals and call.when == "call" and report.passed:
        report.outcome, report.longrepr = "failed", "\n".join(no_launch.refusals)
    if call.when == "teardown":
        no_launch.refusals.clear()


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """One intra-op thread for a module's tests (``pytestmark = pytest.mark.usefixtures("one_thread")``): on tiny
    tensors a second thread only spin-waits, and on 2 shared cores (the suite's other processes, other users) the two
    wait on each other, tenfold and more."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def pair_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small generated sentence-pair dataset (CLUE format) with its vocab in ``tokenizer/``."""
    from lightning_llm.data import generate_pair_dataset

    return generate_pair_dataset(tmp_path_factory.mktemp("pairs"), n_train=64, n_val=32, n_test=24, seed=0)


def padded_lm_batch(vocab: int, seq: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids [3, seq], attention mask (row 1 right-padded from 3/4 of the row, row 2 left-padded by 4) and HF labels:
    the input ids, -100 where a label is padding or follows a padded input (a padded query's output is not a model's
    value on either side)."""
    import torch

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, vocab, (3, seq), generator=g)
    mask = torch.ones_like(ids)
    mask[1, seq * 3 // 4:] = 0
    mask[2, :4] = 0
    labels = ids.clone()
    labels[mask == 0] = -100
    labels[:, 1:][mask[:, :-1] == 0] = -100
    return ids, mask, labels


def loaded_logits_error(path: Path, ids: torch.Tensor, mask: torch.Tensor, ref: torch.Tensor, *, lazy: bool) -> float:
    """``max |logits - ref|`` on the real tokens (``mask``) of the checkpoint at ``path`` loaded by ``load_hf``
    eagerly, or lazily (indexed) and then materialized, in eval mode."""
    import torch

    from lightning_llm.models import load_hf
    from lightning_llm.models.init import materialize

    model, _ = load_hf(path, lazy=lazy)
    if lazy:
        materialize(model, "cpu")
    with torch.no_grad():
        return float((model.eval()(ids, attention_mask=mask) - ref)[mask.bool()].abs().max())


def tiny_hf_llama(out: Path, *, tie_word_embeddings: bool = False, max_new_tokens: int | None = None,
                  max_position_embeddings: int = 128) -> Path:
    """Write a tiny random ``LlamaForCausalLM`` (GQA, 2 layers, vocabulary 304) and a BPE tokenizer trained with
    ``tokenizers`` on the generated corpus to ``out``, as ``save_pretrained`` writes them; ``max_new_tokens``: a
    value only the backbone's ``generation_config.json`` has."""
    import warnings

    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from lightning_llm.data.text import generated_corpus

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(generated_corpus(50), trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<pad>", "<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
                            ).save_pretrained(str(out))
    config = LlamaConfig(vocab_size=304, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_position_embeddings,
                         tie_word_embeddings=tie_word_embeddings, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    if max_new_tokens is not None:
        model.generation_config.max_new_tokens = max_new_tokens
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.save_pretrained(str(out))
    return out


@pytest.fixture(scope="session")
def built_once(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BuiltOnce]:
    """``built_once(key, build)``: a folder built once per test run (:mod:`tests.built_once`), only read by tests
    (checked when the session ends)."""
    built = BuiltOnce(shared_root(tmp_path_factory.getbasetemp()))
    yield built
    assert not built.changed(), f"a test wrote into these shared folders: {built.changed()}"


@pytest.fixture(scope="session")
def tiny_llama(built_once: BuiltOnce) -> Callable[..., Path]:
    """``tiny_llama(**options)``: :func:`tiny_hf_llama`'s folder for ``options``, built once per test run; copy it
    before changing it."""
    def folder(**options: object) -> Path:
        key = "-".join(["llama", *(f"{k}={v}" for k, v in sorted(options.items()))])
        return built_once(key, lambda out: tiny_hf_llama(out, **options))
    return folder


def _restored_environment() -> Iterator[None]:
    before = dict(os.environ)
    yield
    for key in set(os.environ) - set(before):
        del os.environ[key]
    os.environ.update(before)


@pytest.fixture(autouse=True)
def _restore_environment() -> Iterator[None]:
    """Undo what a test's in-process run left in ``os.environ``: Lightning and DeepSpeed set ``MASTER_PORT`` (and
    ``PL_GLOBAL_SEED``, ``RANK``, ...) when a 1-device run initializes a process group, and the port can stay bound
    by this process; every later subprocess (torchrun tests, the CLI) would inherit it and fail with EADDRINUSE."""
    yield from _restored_environment()


@pytest.fixture(autouse=True, scope="module")
def _restore_environment_after_module() -> Iterator[None]:
    """The same around a module: its module-scoped fixtures run before a test's own restore starts (``lightning_llm
    eval`` in-process sets ``HF_HUB_OFFLINE=1``). Left in place, such a variable read at import would send every later
    launch to a fresh interpreter instead of the zygote (:func:`lightning_llm.testing.zygote.enabled`)."""
    yield from _restored_environment()


def peft_twin(ours: object, hf: object, cfg: object, *, seed: int = 3, scale: float = 0.1) -> object:
    """Give every LoRA tensor of ``ours`` (a family model after ``apply_peft(cfg)``) random values and return peft's
    model of ``hf`` (the transformers model of the same checkpoint) with the same adapter: what the LoRA tests compare
    against."""
    import peft
    import torch

    g = torch.Generator().manual_seed(seed)
    lora = [(n, p) for n, p in ours.named_parameters() if "lora_" in n]  # type: ignore[attr-defined]
    ref = peft.get_peft_model(hf, cfg.peft_config())  # type: ignore[attr-defined]
    theirs = dict(ref.named_parameters())
    with torch.no_grad():
        for n, p in lora:
            p.copy_(torch.randn(p.shape, generator=g) * scale)
            theirs[f"base_model.model.model.{n}"].copy_(p)
    return ref
