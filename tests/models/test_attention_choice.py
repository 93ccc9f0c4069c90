"""The attention a run calls, per target and rows: "auto" is cuDNN only where it masks the rows
exactly; an explicit choice that cannot run is refused in one line naming why."""

import pytest

from featherweight.errors import StepConfigError
from featherweight.models import attention_choice
from featherweight.models.attention import PLAIN, ScoreForm
from featherweight.models.attention_choice import AttentionTarget, choose_attention, score_form
from tests.tiny_families import WINDOW, tiny_family

CPU = AttentionTarget("cpu")
TPU = AttentionTarget("tpu")
H100 = AttentionTarget("gpu", "9.0")
A100 = AttentionTarget("gpu", "8.0")

# target, dtype, head dim, rows -> what "auto" calls
AUTO = [
    (CPU, "bfloat16", 128, "packed", "blockwise"),
    (TPU, "bfloat16", 128, "packed", "blockwise"),
    (H100, "bfloat16", 128, "packed", "cudnn"),  # cuDNN's packed layout
    (H100, "bfloat16", 128, "padded", "cudnn_padded"),  # one document per row: lengths
    (H100, "bfloat16", 128, "plain", "cudnn"),
    (H100, "bfloat16", 256, "packed", "cudnn"),
    (H100, "float32", 128, "packed", "blockwise"),
    (A100, "bfloat16", 128, "packed", "blockwise"),  # no packed layout before Hopper
    (A100, "bfloat16", 128, "padded", "cudnn_padded"),
    (A100, "bfloat16", 256, "padded", "blockwise"),  # Ampere's backward stops at 128
]


@pytest.mark.parametrize("target,dtype,head_dim,rows,expected", AUTO)
def test_auto_picks_cudnn_only_where_it_masks_the_rows_exactly(
    target, dtype, head_dim, rows, expected
):
    # the target alone decides (this machine has no cuDNN library: `check_library=False`)
    assert choose_attention("auto", target, dtype, head_dim, rows, check_library=False) == expected


def test_explicit_choices_are_kept_where_they_run():
    assert (
        choose_attention("cudnn", H100, "bfloat16", 128, "packed", check_library=False) == "cudnn"
    )
    cudnn_padded = choose_attention("cudnn", A100, "bfloat16", 128, "padded", check_library=False)
    assert cudnn_padded == "cudnn_padded"
    assert choose_attention("pallas", A100, "bfloat16", 128, "packed") == "pallas"
    assert choose_attention("materialized", H100, "bfloat16", 64, "packed") == "materialized"
    assert choose_attention("blockwise", H100, "bfloat16", 64, "packed") == "blockwise"


@pytest.mark.parametrize(
    "choice,target,dtype,head_dim,rows,words",
    [
        ("cudnn", CPU, "bfloat16", 64, "plain", "NVIDIA GPU"),
        ("cudnn", A100, "bfloat16", 128, "packed", "Hopper and later"),
        ("cudnn", A100, "bfloat16", 256, "padded", "Ampere/Ada"),
        ("cudnn", H100, "float32", 64, "packed", "bfloat16 or float16"),
        ("pallas", CPU, "bfloat16", 128, "packed", "NVIDIA GPU"),
        ("pallas", H100, "bfloat16", 96, "packed", "power of two"),
    ],
)
def test_what_cannot_run_is_refused_in_one_line(choice, target, dtype, head_dim, rows, words):
    with pytest.raises(StepConfigError, match=words) as error:
        choose_attention(choice, target, dtype, head_dim, rows, check_library=False)
    assert "\n" not in str(error.value)


def test_packed_rows_are_refused_when_this_jax_lacks_the_private_layout(monkeypatch):
    # a jax without the private packed API: auto falls back, an explicit cudnn says why
    def missing():
        return "this jax lacks q_offsets"

    monkeypatch.setattr(attention_choice, "cudnn_packed_refusal", missing)
    assert choose_attention("auto", H100, "bfloat16", 128, "packed", False, False) == "blockwise"
    assert choose_attention("auto", H100, "bfloat16", 128, "padded", False, False) == "cudnn_padded"
    with pytest.raises(StepConfigError, match="lacks q_offsets"):
        choose_attention("cudnn", H100, "bfloat16", 128, "packed", check_library=False)


def test_without_cudnns_library_auto_is_blockwise_and_cudnn_says_why(monkeypatch):
    # a machine compiling for a GPU without cuDNN's library (as this one): jax cannot lower the
    # call, so auto keeps blockwise and an explicit cudnn names the reason
    def absent():
        return "cuDNN's library cannot be loaded in this process (cuDNN not found.)"

    monkeypatch.setattr(attention_choice, "cudnn_library_refusal", absent)
    assert choose_attention("auto", H100, "bfloat16", 128, "packed") == "blockwise"
    with pytest.raises(StepConfigError, match="cuDNN's library"):
        choose_attention("cudnn", H100, "bfloat16", 128, "padded")
    monkeypatch.setattr(attention_choice, "cudnn_library_refusal", lambda: None)
    assert choose_attention("auto", H100, "bfloat16", 128, "packed") == "cudnn"


def test_the_installed_jax_has_the_private_packed_layout():
    # the guard reads the real signature: the jax this project pins takes the packed layout
    assert attention_choice.cudnn_packed_refusal() is None


def test_the_old_flash_value_and_unknown_values_are_refused():
    with pytest.raises(StepConfigError, match="blockwise"):
        choose_attention("flash", CPU, "bfloat16", 64, "packed")
    with pytest.raises(StepConfigError, match="auto, blockwise, cudnn, pallas, materialized"):
        choose_attention("fast", CPU, "bfloat16", 64, "packed")


def test_pallas_is_refused_when_this_jaxs_kernel_lacks_what_it_is_called_with(monkeypatch):
    from jax.experimental.pallas.ops.gpu import attention

    assert choose_attention("pallas", H100, "bfloat16", 128, "packed") == "pallas"

    def older_mha(q, k, v, sm_scale=1.0, causal=False, block_sizes=None, interpret=False):
        raise AssertionError("never called")

    monkeypatch.setattr(attention, "mha", older_mha)
    with pytest.raises(StepConfigError, match="lacks segment_ids"):
        choose_attention("pallas", H100, "bfloat16", 128, "packed")


SOFTCAPPED = ScoreForm(softcap=50.0)  # Gemma 2's attn_logit_softcapping
WINDOWED = ScoreForm(window=4096)  # Mistral's, Gemma 3's sliding layers


@pytest.mark.parametrize("rows", ["plain", "padded", "packed"])
def test_auto_runs_a_softcapped_model_blockwise_and_an_explicit_fused_kernel_is_refused(rows):
    # neither fused kernel takes a softcap: auto falls back, an explicit choice says why
    auto = choose_attention("auto", H100, "bfloat16", 256, rows, False, False, SOFTCAPPED)
    assert auto == "blockwise"
    for choice in ("cudnn", "pallas"):
        with pytest.raises(StepConfigError, match=r"no softcap.*50") as error:
            choose_attention(choice, H100, "bfloat16", 256, rows, False, False, SOFTCAPPED)
        assert "\n" not in str(error.value)


@pytest.mark.parametrize("rows", ["plain", "padded", "packed"])
def test_auto_runs_a_model_with_sinks_blockwise_and_an_explicit_fused_kernel_is_refused(rows):
    # gpt-oss: a sink logit per head joins every softmax; no fused kernel takes it, window or not
    form = score_form(tiny_family("gpt_oss"))
    assert form.sinks and form.window is not None
    assert choose_attention("auto", H100, "bfloat16", 64, rows, False, False, form) == "blockwise"
    for choice in ("cudnn", "pallas"):
        with pytest.raises(StepConfigError, match="no attention sinks"):
            choose_attention(choice, H100, "bfloat16", 64, rows, False, False, form)


@pytest.mark.parametrize("rows", ["plain", "padded", "packed"])
def test_a_windowed_model_runs_blockwise_and_an_explicit_fused_kernel_is_refused(rows):
    # cuDNN's public call takes `local_window_size`, but a windowed Gemma 3 step through it did
    # not match blockwise's gradients on an H200: not chosen, and refused when named; nor Pallas
    args = (H100, "bfloat16", 128)
    assert choose_attention("auto", *args, rows, False, False, WINDOWED) == "blockwise"
    with pytest.raises(
        StepConfigError, match=r"sliding window \(this model's is 4096\).*blockwise"
    ):
        choose_attention("cudnn", *args, rows, False, False, WINDOWED)
    with pytest.raises(StepConfigError, match=r"Pallas.*no sliding window"):
        choose_attention("pallas", *args, rows, form=WINDOWED)
    assert choose_attention("auto", *args, rows, False, False, PLAIN) != "blockwise"


@pytest.mark.parametrize(
    "family,form",
    [
        ("gemma2", ScoreForm(64**-0.5, 50.0, WINDOW)),  # query_pre_attn_scalar, softcap
        ("gemma3", ScoreForm(48**-0.5, None, WINDOW)),  # no softcap; sliding layers
        ("qwen3", ScoreForm(48**-0.5, None, None)),  # head_dim 48, not hidden / heads = 32
    ],
)
def test_a_models_score_form_is_what_its_family_sets(family, form):
    assert score_form(tiny_family(family)) == pytest.approx(form)


def test_a_window_no_shorter_than_the_context_is_no_window():
    # Phi-3.5-mini slides 262,144 positions over a 131,072 context: cuDNN's packed rows stay
    assert score_form(tiny_family("phi3", sliding_window=4096)).window is None
    assert score_form(tiny_family("phi3", sliding_window=4095)).window == 4095
