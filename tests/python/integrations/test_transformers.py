"""Hugging Face transformers' Trainer with mixedprec (docs/integrations.md): a tiny GPT-2
built from a config (nothing downloaded) with bf16 weights, trained by
``mixedprec.optim.AdamW`` with fp32 masters (or a lean mode) handed in through
``optimizers=`` or ``optimizer_cls_and_kwargs``, compared bit for bit with the plain
loop it stands for; and resume from the Trainer's checkpoint against an uninterrupted
run. CPU, a few steps; skipped without transformers."""

import pytest
import torch
from helpers import assert_bitwise_equal

import mixedprec

transformers = pytest.importorskip("transformers")

SEQS, BATCH, SEQ, VOCAB = 48, 8, 16, 64  # an epoch of 6 batches
LR, WEIGHT_DECAY, MAX_GRAD_NORM = 1e-3, 0.1, 1.0


def gpt2():
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2,
                                     n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                     bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).to(torch.bfloat16)


def tokens():
    return torch.randint(0, VOCAB, (SEQS, SEQ), generator=torch.Generator().manual_seed(1))


class Tokens(torch.utils.data.Dataset):
    def __init__(self):
        self.x = tokens()

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.x[i]}


def param_groups(model):
    """The Trainer's own grouping: weight decay on the matrices (GPT-2's weights and
    embeddings), none on biases and LayerNorm weights."""
    params = list(model.parameters())
    return [{"params": [p for p in params if p.ndim >= 2], "weight_decay": WEIGHT_DECAY},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]


def optimizer_kwargs(master, state_dtype):
    seed = {"seed": 3} if master == "stochastic" else {}
    return dict(lr=LR, master=master, state_dtype=state_dtype, **seed)


def arguments(tmp_path, steps, **kwargs):
    return transformers.TrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, per_device_train_batch_size=BATCH,
        max_steps=steps, learning_rate=LR, weight_decay=WEIGHT_DECAY,
        max_grad_norm=MAX_GRAD_NORM, lr_scheduler_type="constant",
        train_sampling_strategy="sequential", report_to=[], disable_tqdm=True,
        logging_strategy="no", **kwargs)


def trainer(tmp_path, steps, how, master, state_dtype, **kwargs):
    model = gpt2()
    given = {}
    if how == "optimizers":
        opt = mixedprec.optim.AdamW(param_groups(model), **optimizer_kwargs(master, state_dtype))
        given["optimizers"] = (opt, None)
    else:
        given["optimizer_cls_and_kwargs"] = (mixedprec.optim.AdamW,
                                             optimizer_kwargs(master, state_dtype))
    return transformers.Trainer(model=model, args=arguments(tmp_path, steps, **kwargs),
                                train_dataset=Tokens(), **given)


def plain_loop(steps, master, state_dtype):
    """What the Trainer stands for: its loss is the summed token loss over the batch's
    count of labels (``num_items_in_batch``), its gradients clipped to MAX_GRAD_NORM."""
    model = gpt2()
    opt = mixedprec.optim.AdamW(param_groups(model), **optimizer_kwargs(master, state_dtype))
    x = tokens()
    for step in range(steps):
        batch = x[step * BATCH % SEQS:][:BATCH]
        opt.zero_grad()
        model(input_ids=batch, labels=batch,
              num_items_in_batch=torch.tensor(float(batch.numel()))).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
        opt.step()
    return model


def assert_same_params(actual, expected):
    for (name, a), (_, e) in zip(actual.named_parameters(), expected.named_parameters(),
                                 strict=True):
        assert_bitwise_equal(a.detach(), e.detach(), name)


CASES = [
    pytest.param("optimizers", "fp32", torch.float32, id="optimizers-fp32-masters"),
    pytest.param("optimizer_cls_and_kwargs", "fp32", torch.float32, id="cls-and-kwargs"),
    pytest.param("optimizer_cls_and_kwargs", "kahan", torch.bfloat16,
                 id="cls-and-kwargs-kahan-bf16-state"),
]


@pytest.mark.parametrize("how, master, state_dtype", CASES)
def test_trainer_trains_bf16_weights_as_the_plain_loop(tmp_path, how, master, state_dtype):
    if how == "optimizer_cls_and_kwargs" and "optimizer_cls_and_kwargs" not in \
            transformers.Trainer.__init__.__code__.co_varnames:
        pytest.skip("this transformers' Trainer has no optimizer_cls_and_kwargs")
    t = trainer(tmp_path, 8, how, master, state_dtype, save_strategy="no")
    t.train()
    assert_same_params(t.model, plain_loop(8, master, state_dtype))
    assert all(p.dtype == torch.bfloat16 for p in t.model.parameters())
    # the Trainer stepped mixedprec's optimizer, with the Trainer's weight-decay groups
    opt = t.optimizer.optimizer  # (Accelerate's wrapper around it)
    assert type(opt) is mixedprec.optim.AdamW and opt.master == master
    expected = param_groups(t.model)
    assert [[id(p) for p in g["params"]] for g in opt.param_groups] == \
        [[id(p) for p in g["params"]] for g in expected]
    assert [g["weight_decay"] for g in opt.param_groups] == [WEIGHT_DECAY, 0.0]
    state = opt.state[t.model.transformer.wte.weight]
    assert state["exp_avg"].dtype == state_dtype and state["step"] == 8
    if master == "fp32":
        assert_bitwise_equal(t.model.transformer.wte.weight.detach(),
                             state["master_param"].to(torch.bfloat16))


@pytest.mark.parametrize("master, state_dtype", [("fp32", torch.float32),
                                                 ("stochastic", torch.bfloat16)],
                         ids=["fp32-masters", "stochastic-bf16-state"])
def test_resume_from_the_trainers_checkpoint_is_exact(tmp_path, master, state_dtype):
    straight = trainer(tmp_path / "a", 8, "optimizers", master, state_dtype,
                       save_strategy="no")
    straight.train()
    # stopped after 4 steps, in the middle of the first epoch, and resumed to 8
    first = trainer(tmp_path / "b", 4, "optimizers", master, state_dtype,
                    save_strategy="steps", save_steps=4)
    first.train()
    checkpoint = tmp_path / "b" / "checkpoint-4"
    assert (checkpoint / "optimizer.pt").is_file()
    resumed = trainer(tmp_path / "b", 8, "optimizers", master, state_dtype,
                      save_strategy="no")
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert resumed.state.global_step == 8
    assert_same_params(resumed.model, straight.model)
    a = straight.optimizer.state_dict()["state"]
    b = resumed.optimizer.state_dict()["state"]
    for index in a:
        for key in a[index]:
            assert_bitwise_equal(b[index][key], a[index][key], f"state {index} {key}")
    assert b[0]["step"] == 8
