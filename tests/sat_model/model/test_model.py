"""The decoder of Show, Attend and Tell: shapes, attention, gradients, state, overfitting."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from sat_model.config import HardTrainConfig, ModelParams, SoftTrainConfig
from sat_model.model.decoder import (
    HardAttention,
    ModelConfig,
    ShowAttendTell,
    SoftAttention,
)
from sat_model.model.factory import build_model
from sat_model.model.losses import build_criterion
from tests.factories import TINY_D, TINY_K, TINY_L, tiny_batch, tiny_model

K, D, L = TINY_K, TINY_D, TINY_L


@pytest.mark.parametrize("attention", ["soft", "hard"])
@pytest.mark.parametrize("mode", ["train", "expected", "sample", "argmax"])
def test_alpha_sums_to_one_over_locations(attention: str, mode: str) -> None:
    torch.manual_seed(0)
    annotations, captions = tiny_batch()
    out = tiny_model(attention)(annotations, captions, mode=mode)
    B, T = captions.shape[0], captions.shape[1] - 1
    assert out.logits.shape == (B, T, K)
    assert out.alphas.shape == (B, T, L)
    assert out.betas.shape == (B, T)
    assert (out.alphas >= 0).all()
    torch.testing.assert_close(out.alphas.sum(-1), torch.ones(B, T))


def test_hard_attention_outputs_path_log_probs_and_entropy_when_sampling() -> None:
    torch.manual_seed(0)
    annotations, captions = tiny_batch()
    out = tiny_model("hard")(annotations, captions, mode="train")
    B, T = captions.shape[0], captions.shape[1] - 1
    assert out.location_log_probs is not None and out.location_log_probs.shape == (B, T)
    assert out.entropy is not None and out.entropy.shape == (B, T)
    assert (out.location_log_probs <= 0).all()
    # entropy of a distribution over L outcomes lies in [0, log L]
    assert (out.entropy >= 0).all() and (out.entropy <= torch.log(torch.tensor(L)) + 1e-5).all()


@pytest.mark.parametrize("attention", ["soft", "hard"])
def test_every_trainable_parameter_gets_a_gradient(attention: str) -> None:
    torch.manual_seed(0)
    model = tiny_model(attention, dropout=0.3, semi_sampling_p=0.5)
    # λ > 0: the doubly stochastic term of Eq. 14 is part of the graph too
    cfg = SoftTrainConfig(doubly_stochastic=1.0) if attention == "soft" else HardTrainConfig()
    criterion = build_criterion(attention, cfg)
    annotations, captions = tiny_batch()
    criterion(model(annotations, captions), captions).loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, f"{name} got no gradient"
        assert torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, f"{name} got a zero gradient"


@pytest.mark.parametrize("attention", ["soft", "hard"])
def test_training_under_bfloat16_autocast_gives_float32_gradients_near_float32_training(
    attention: str,
) -> None:
    """train.mixed_precision: bf16 runs the training pass under autocast (the readable code:
    the backend declines autocast), bf16 activations next to float32 parameters. Hard
    attention at forced locations, so that both precisions take the same path s̃."""
    torch.manual_seed(0)
    model = tiny_model(attention, coordinates=True, grid_w=3, normalize_features=True)
    annotations, captions = tiny_batch()
    locations = torch.randint(0, L, (4, captions.size(1) - 1)) if attention == "hard" else None
    cfg = SoftTrainConfig(doubly_stochastic=1.0) if attention == "soft" else HardTrainConfig()
    runs = []
    for autocast in (False, True):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = model(annotations, captions, locations=locations)
            loss = build_criterion(attention, cfg)(out, captions).loss
        loss.backward()
        runs.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (loss32, grads32), (loss16, grads16) = runs
    assert torch.isfinite(loss16)
    # bfloat16 keeps 8 bits of mantissa (~0.4 %): the loss within a few percent of float32's
    torch.testing.assert_close(loss16.float(), loss32, rtol=0.05, atol=0.0)
    for name, p in model.named_parameters():
        g = grads16[name]
        assert g is not None and g.dtype == p.dtype, f"{name}: {None if g is None else g.dtype}"
        assert torch.isfinite(g).all(), name
        cosine = torch.nn.functional.cosine_similarity(g.flatten(), grads32[name].flatten(), 0)
        assert cosine > 0.98, f"{name}: cosine {cosine:.3f} to the float32 gradient"


@pytest.mark.parametrize("attention", ["soft", "hard"])
def test_no_nans_on_random_tensors(attention: str) -> None:
    torch.manual_seed(1)
    model = tiny_model(attention, dropout=0.5)
    annotations = 50 * torch.randn(5, L, D)  # large activations saturate tanh/softmax
    captions = torch.randint(0, K, (5, 9))
    out = model(annotations, captions)
    cfg = SoftTrainConfig() if attention == "soft" else HardTrainConfig()
    loss = build_criterion(attention, cfg)(out, captions).loss
    loss.backward()
    assert torch.isfinite(out.logits).all() and torch.isfinite(out.alphas).all()
    assert torch.isfinite(loss)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


@pytest.mark.parametrize("attention", ["soft", "hard"])
def test_forward_equals_a_loop_of_step(attention: str) -> None:
    model = tiny_model(attention).eval()
    annotations, captions = tiny_batch()
    out = model(annotations, captions)
    state = model.init_state(annotations)
    for t in range(captions.shape[1] - 1):
        step = model.step(captions[:, t], state, "expected")
        torch.testing.assert_close(step.logits, out.logits[:, t])
        torch.testing.assert_close(step.alpha, out.alphas[:, t])
        state = step.state


def test_annotation_projection_is_computed_once_per_forward() -> None:
    model = tiny_model("soft")
    calls = []
    model.attention.annotation_proj.register_forward_hook(lambda *_: calls.append(1))
    annotations, captions = tiny_batch()
    model(annotations, captions)
    assert len(calls) == 1  # W_a a_i does not depend on t (Eq. 4)


def test_soft_attention_scores_follow_eq_4_and_5() -> None:
    torch.manual_seed(0)
    att = SoftAttention(annotation_dim=3, hidden_dim=2, attention_dim=4)
    a, h = torch.randn(2, 5, 3), torch.randn(2, 2)
    out = att(a, att.project(a), h)
    W_a, b = att.annotation_proj.weight, att.annotation_proj.bias
    e = torch.tanh(a @ W_a.T + b + (h @ att.hidden_proj.weight.T)[:, None]) @ att.score.weight[0]
    alpha = torch.exp(e) / torch.exp(e).sum(1, keepdim=True)
    torch.testing.assert_close(out.alpha, alpha)
    torch.testing.assert_close(out.context, (alpha[..., None] * a).sum(1))


def test_without_gate_beta_is_one() -> None:
    annotations, captions = tiny_batch()
    out = tiny_model("soft", gate=False)(annotations, captions)
    torch.testing.assert_close(out.betas, torch.ones_like(out.betas))


@pytest.mark.parametrize(("p", "expected_sampled"), [(0.0, True), (1.0, False)])
def test_semi_sampling_probability_controls_which_images_sample(
    p: float, expected_sampled: bool
) -> None:
    annotations, captions = tiny_batch()
    out = tiny_model("hard", semi_sampling_p=p)(annotations, captions)
    assert out.sampled is not None
    assert out.sampled.tolist() == [expected_sampled] * 4


def test_semi_sampling_per_batch_draws_one_coin_for_the_whole_batch() -> None:
    torch.manual_seed(0)
    model = tiny_model("hard", semi_sampling_p=0.5, semi_sampling_per="batch")
    annotations, captions = tiny_batch()
    seen = set()
    for _ in range(20):
        sampled = model(annotations, captions).sampled
        assert sampled is not None
        assert len(set(sampled.tolist())) == 1
        seen.add(bool(sampled[0]))
    assert seen == {True, False}  # P(20 equal coins) = 2^-19


def test_semi_sampled_images_use_the_expected_context() -> None:
    torch.manual_seed(0)
    annotations, captions = tiny_batch()
    hard = tiny_model("hard", semi_sampling_p=1.0)
    soft = tiny_model("soft")
    soft.load_state_dict(hard.state_dict())  # same parameters; soft has no sampling
    torch.testing.assert_close(
        hard(annotations, captions).logits, soft(annotations, captions).logits
    )


def test_state_dict_round_trips_and_config_is_json() -> None:
    torch.manual_seed(0)
    model = tiny_model("hard").eval()
    text = json.dumps(dataclasses.asdict(model.config))
    clone = ShowAttendTell(ModelConfig(**json.loads(text)))
    clone.load_state_dict(model.state_dict())
    clone.eval()
    annotations, captions = tiny_batch()
    torch.testing.assert_close(
        clone(annotations, captions).logits, model(annotations, captions).logits
    )


def test_build_model_reads_model_params() -> None:
    params = ModelParams(
        embed_dim=6, hidden_dim=10, attention_dim=5, dropout=0.1, gate=False, coordinates=False
    )
    model = build_model(params, vocab_size=K, annotation_dim=D, num_locations=L, attention="hard")
    assert model.config.embed_dim == 6 and model.config.hidden_dim == 10
    assert model.config.attention == "hard" and model.gate is None
    assert model.lstm.input_size == 6 + D  # [E y_{t-1}; ẑ_t], Eq. 1


def test_coordinates_widen_the_annotations_by_x_and_y() -> None:
    params = ModelParams(embed_dim=6, hidden_dim=10, attention_dim=5, coordinates=True)
    model = build_model(
        params, vocab_size=K, annotation_dim=D, num_locations=L, attention="soft", grid_w=3
    )
    assert model.lstm.input_size == 6 + D + 2
    # a 2 x 3 grid, row-major: cell centres at x in {-2/3, 0, 2/3}, y in {-1/2, 1/2}
    expected = [[x, y] for y in (-0.5, 0.5) for x in (-2 / 3, 0.0, 2 / 3)]
    torch.testing.assert_close(model.coords, torch.tensor(expected))
    assert "coords" not in model.state_dict()  # rebuilt from the config, never saved


def test_coordinates_tell_apart_cells_with_identical_features() -> None:
    """Without coordinates, attending to either of two identical cells gives the same ẑ_t;
    with them, the context vector says which cell it came from."""
    annotations = torch.zeros(1, L, D)
    annotations[0, 0] = annotations[0, L - 1] = 1.0  # the same object in two corners
    first, last = torch.zeros(1, L), torch.zeros(1, L)
    first[0, 0], last[0, L - 1] = 1.0, 1.0
    for coordinates, differ in ((False, False), (True, True)):
        model = tiny_model(coordinates=coordinates, grid_w=3)
        state = model.init_state(annotations)
        z_first = torch.bmm(first.unsqueeze(1), state.annotations)
        z_last = torch.bmm(last.unsqueeze(1), state.annotations)
        assert (not torch.equal(z_first, z_last)) is differ


def test_coordinates_need_a_grid_that_tiles_the_locations() -> None:
    with pytest.raises(ValueError, match="grid_w"):
        tiny_model(coordinates=True, grid_w=4)  # 4 columns cannot tile L = 6


def test_build_model_rejects_unknown_attention() -> None:
    with pytest.raises(ValueError, match="'glimpse'"):
        build_model(
            ModelParams(), vocab_size=K, annotation_dim=D, num_locations=L, attention="glimpse"
        )


def test_model_rejects_annotations_of_the_wrong_shape() -> None:
    _, captions = tiny_batch()
    with pytest.raises(ValueError, match=r"\(4, 7, 8\)"):
        tiny_model()(torch.zeros(4, 7, D), captions)


def test_unknown_mode_is_rejected() -> None:
    annotations, captions = tiny_batch()
    with pytest.raises(ValueError, match="'greedy'"):
        tiny_model()(annotations, captions, mode="greedy")


@pytest.mark.slow
@pytest.mark.parametrize("attention", ["soft", "hard"])
def test_a_tiny_batch_is_overfit(attention: str) -> None:
    torch.manual_seed(0)
    model = tiny_model(attention, semi_sampling_p=0.5)
    cfg = SoftTrainConfig() if attention == "soft" else HardTrainConfig()
    criterion = build_criterion(attention, cfg)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    annotations, captions = tiny_batch()
    for _ in range(300):
        optimizer.zero_grad()
        criterion(model(annotations, captions), captions).loss.backward()
        optimizer.step()
    model.eval()
    nll = criterion(model(annotations, captions), captions).nll
    # start: log K ≈ 2.5 nats per token
    assert nll < 0.05, f"mean per-token NLL {float(nll):.3f} after 300 steps"


def test_sampled_locations_follow_alpha() -> None:
    """s̃_t ~ Multinoulli(α_t) (Eq. 8): with a_i = e_i the context is the one-hot of s̃_t, so
    location frequencies over many draws must match α within Monte-Carlo error."""
    torch.manual_seed(0)
    att = HardAttention(annotation_dim=L, hidden_dim=3, attention_dim=4)
    rows = 20_000
    annotations = torch.eye(L).expand(rows, L, L)  # (rows, L, D=L), a_i = e_i
    hidden = torch.randn(1, 3).expand(rows, 3)  # the same α in every row
    out = att(annotations, att.project(annotations), hidden, mode="sample")
    frequency = out.context.mean(0)  # (L,)
    alpha = out.alpha[0]
    # 5 standard errors of a frequency estimated from `rows` draws
    tolerance = 5 * torch.sqrt(alpha * (1 - alpha) / rows) + 1e-4
    assert ((frequency - alpha).abs() <= tolerance).all(), (frequency, alpha)
    assert torch.equal(out.context.sum(1), torch.ones(rows))  # exactly one location per draw


def test_feature_standardisation_feeds_the_decoder_standardised_annotations() -> None:
    annotations, captions = tiny_batch()
    mean, std = torch.linspace(-2, 2, D), torch.linspace(0.5, 3, D)
    torch.manual_seed(0)
    normalised = tiny_model("soft", normalize_features=True)
    normalised.set_feature_statistics(mean, std)
    torch.manual_seed(0)
    plain = tiny_model("soft")  # same weights, no standardisation
    normalised.eval(), plain.eval()
    torch.testing.assert_close(
        normalised(annotations, captions).logits,
        plain((annotations - mean) / std, captions).logits,
    )
    state = normalised.state_dict()  # the statistics travel with the checkpoint
    torch.testing.assert_close(state["feature_mean"], mean)
    torch.testing.assert_close(state["feature_std"], std)


@pytest.mark.parametrize("backend", ["native", "readable"])
@pytest.mark.parametrize("attention", ["soft", "hard"])
def test_input_dropout_drops_the_lstms_embedding_input_in_training_only(
    attention: str, backend: str
) -> None:
    """``input_dropout`` masks E y_{t-1} on its way into the LSTM while training: the same weights
    without it give other logits in training mode and the same ones in eval mode."""
    annotations, captions = tiny_batch()
    locations = torch.zeros(4, captions.size(1) - 1, dtype=torch.long)  # hard: forced s̃
    forced = {"locations": locations} if attention == "hard" else {}
    torch.manual_seed(0)
    plain = tiny_model(attention, backend)
    dropped = tiny_model(attention, backend, input_dropout=0.5)
    dropped.load_state_dict(plain.state_dict())
    for mode, same in (("train", False), ("eval", True)):
        plain.train(mode == "train"), dropped.train(mode == "train")
        torch.manual_seed(1)
        want = plain(annotations, captions, **forced).logits
        torch.manual_seed(1)
        got = dropped(annotations, captions, **forced).logits
        assert torch.allclose(got, want) is same, mode


def test_input_dropout_must_be_a_probability_below_one() -> None:
    with pytest.raises(ValueError, match="input_dropout"):
        tiny_model(input_dropout=1.0)


@pytest.mark.parametrize(
    ("attention", "mode"), [("soft", "expected"), ("hard", "expected"), ("hard", "argmax")]
)
def test_images_prepared_once_for_their_captions_give_the_repeated_pass(
    attention: str, mode: str
) -> None:
    """Self-critical training's pass: two images for six captions (``rows_per_image=3``) give
    the logits and gradients of the same pass over each image's annotations repeated three
    times, through the kernels' recurrence and the step loop (hard attention's argmax path)."""
    annotations, captions = tiny_batch()
    images, rows = annotations[:2], torch.cat([captions[:3], captions[1:]])
    results = []
    for repeated in (True, False):
        torch.manual_seed(0)
        model = tiny_model(attention).eval()
        if repeated:
            out = model(images.repeat_interleave(3, dim=0), rows, mode=mode)
        else:
            out = model(images, rows, mode=mode, rows_per_image=3)
        out.logits.logsumexp(-1).mean().backward()
        results.append((out.logits, [p.grad for p in model.parameters()]))
    (want_logits, want_grads), (logits, grads) = results
    torch.testing.assert_close(logits, want_logits)
    for got, want in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    with pytest.raises(ValueError, match="6 captions for 2 images at rows_per_image=2"):
        tiny_model(attention)(images, rows, rows_per_image=2)
