"""Produce checkpoint folders written by diffusers' text-to-image training loops and by accelerate with two models.

Every file under ``<out>/<set>/ckpts`` (and ``<out>/<set>/pretrained``) is written by the frameworks' own
saving code: ``Accelerator.save_state`` with the save hooks the diffusers example scripts register,
``EMAModel.save_pretrained``, ``ModelMixin.save_pretrained``, ``StableDiffusionPipeline.save_lora_weights`` and
``DiffusionPipeline.save_pretrained``. Nothing is laid out by hand. Beside the checkpoints,
``<out>/<set>/oracle/`` holds each checkpoint's weights as the framework's own loading code reads them, and
``<out>/<set>/producer.json`` records versions, the command, the optimizer step of each checkpoint as the training
loop knew it, and the step counters the saved files themselves record.

Sets:

* ``diffusers-t2i-ema``: the training and saving logic of diffusers' ``examples/text_to_image/train_text_to_image.py``
  with ``--use_ema``: a tiny Stable Diffusion (``UNet2DConditionModel``, ``AutoencoderKL``, ``CLIPTextModel``,
  ``CLIPTokenizer``, ``DDPMScheduler``) read with ``from_pretrained`` from ``pretrained/``; only the unet trains;
  ``EMAModel`` of the unet stepped after every optimizer step; ``save_state`` every 2 optimizer steps into
  ``ckpts/checkpoint-<global_step>`` with the script's save hook (``unet/`` and ``unet_ema/`` as diffusers model
  folders, the model weights popped from accelerate's list) and the script's ``checkpoints_total_limit=3`` deletion;
  at the end the script's pipeline export (EMA weights copied into the unet) into ``ckpts/`` itself.
* ``diffusers-t2i-lora``: the same for ``train_text_to_image_lora.py``: frozen unet with a peft LoRA adapter,
  the script's save hook writing ``pytorch_lora_weights.safetensors`` into each ``checkpoint-N``, and the final
  ``pytorch_lora_weights.safetensors`` in ``ckpts/``.
* ``accelerate-two-models``: ``Accelerator.save_state()`` with two prepared models (a generator and a
  discriminator MLP), each with its own AdamW and LR scheduler, ``automatic_checkpoint_naming=True``.

The example scripts are not part of the diffusers wheel: the loops here make the same library calls in the same
order (argument parsing, datasets, logging, trackers, validation and hub uploads left out; random images and
captions stand in for the dataset).

Usage (from the repository root; a virtualenv with tests/producers/trainers/requirements.txt plus diffusers)::

    .venv-fixtures/bin/python tests/producers/trainers/diffusers_accelerate.py \\
        --out tests/fixtures/trainers --set all

``--set`` takes ``all`` or a comma-separated list of set names. Each set directory is deleted and rewritten.
Training runs in a child process (``--worker``, one process, ``OMP_NUM_THREADS=1``, the set folder as working
directory and relative paths throughout, so no absolute path lands in the files); a second child process
(``--worker oracle``) reads the written files back with the frameworks' loaders (``from_pretrained``,
``EMAModel.from_pretrained``, ``load_lora_weights``, ``Accelerator.load_state`` with the scripts' load hooks) and
writes ``oracle/``. No CPU patch: all of this runs on CPU as it is.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fixture_common import (
    TORCHRUN_VARS,
    fresh_set_dir,
    optimizer_steps,
    package_versions,
    run_producer,
    run_worker,
    write_oracle,
)

THIS = Path(__file__).resolve()
SCRIPT_REL = "tests/producers/trainers/diffusers_accelerate.py"
SEED = 1234
WORKER_RECORD = "_worker.json"  # what the training loop knew at each save; read and removed
ORACLE_RECORD = "_oracle.json"
LIVE_DIR = "_live"  # the live weights at each save (train worker -> oracle worker); removed

SETS: dict[str, dict] = {
    "diffusers-t2i-ema": {"kind": "t2i", "lora": False},
    "diffusers-t2i-lora": {"kind": "t2i", "lora": True},
    "accelerate-two-models": {"kind": "two_models"},
}

# ---------------------------------------------------------------------------------------------
# The tiny Stable Diffusion written to pretrained/ (the scripts' --pretrained_model_name_or_path)
# ---------------------------------------------------------------------------------------------

PRETRAINED = "pretrained"
OUTPUT_DIR = "ckpts"
UNET_CONFIG = dict(
    sample_size=8,
    in_channels=4,
    out_channels=4,
    layers_per_block=1,
    block_out_channels=[4],
    down_block_types=["CrossAttnDownBlock2D"],
    up_block_types=["CrossAttnUpBlock2D"],
    mid_block_type=None,  # one resolution level and no mid block keep the files small (122 tensors)
    cross_attention_dim=8,
    norm_num_groups=2,
    attention_head_dim=2,
)
VAE_CONFIG = dict(
    in_channels=3,
    out_channels=3,
    down_block_types=["DownEncoderBlock2D"],
    up_block_types=["UpDecoderBlock2D"],
    block_out_channels=[4],
    layers_per_block=1,
    latent_channels=4,
    norm_num_groups=2,
    sample_size=8,
)
# Stable Diffusion v1's noise schedule
SCHEDULER_CONFIG = dict(
    num_train_timesteps=1000,
    beta_start=0.00085,
    beta_end=0.012,
    beta_schedule="scaled_linear",
    prediction_type="epsilon",
)
TOKENIZER_MAX_LENGTH = 8
WORDS = ["a", "cat", "dog", "red", "blue", "on", "the", "mat", "sky", "tree"]


def tokenizer_vocab() -> tuple[dict[str, int], list[str]]:
    """A CLIP-style BPE vocabulary (single letters, letters ending a word, one merge chain per word of WORDS,
    then the two special tokens) and its merges."""
    letters = "abcdefghijklmnopqrstuvwxyz"
    vocab: dict[str, int] = {}
    for c in letters:
        vocab[c] = len(vocab)
    for c in letters:
        vocab[c + "</w>"] = len(vocab)
    merges: list[str] = []
    for word in WORDS:
        if len(word) < 2:
            continue
        parts = [*word[:-1], word[-1] + "</w>"]
        while len(parts) > 1:
            merges.append(f"{parts[0]} {parts[1]}")
            parts = [parts[0] + parts[1], *parts[2:]]
            vocab.setdefault(parts[0], len(vocab))
    vocab["<|startoftext|>"] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    return vocab, merges


def text_encoder_config(vocab: dict[str, int]) -> dict:
    return dict(
        vocab_size=len(vocab),
        hidden_size=UNET_CONFIG["cross_attention_dim"],
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        max_position_embeddings=TOKENIZER_MAX_LENGTH,
        projection_dim=8,
        bos_token_id=vocab["<|startoftext|>"],
        eos_token_id=vocab["<|endoftext|>"],
        pad_token_id=vocab["<|endoftext|>"],
    )


def write_pretrained(tmp: Path) -> dict:
    """Random tiny components saved by StableDiffusionPipeline.save_pretrained into PRETRAINED/ (the layout of a
    Stable Diffusion v1 repository, without safety checker and feature extractor). The tokenizer is read by
    CLIPTokenizer.from_pretrained from a vocab.json / merges.txt written into ``tmp``."""
    import torch
    from diffusers import AutoencoderKL, DDPMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

    vocab, merges = tokenizer_vocab()
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "vocab.json").write_text(json.dumps(vocab))
    (tmp / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    tokenizer = CLIPTokenizer.from_pretrained(str(tmp), model_max_length=TOKENIZER_MAX_LENGTH)
    torch.manual_seed(SEED)
    unet = UNet2DConditionModel(**UNET_CONFIG)
    vae = AutoencoderKL(**VAE_CONFIG)
    text_encoder = CLIPTextModel(CLIPTextConfig(**text_encoder_config(vocab)))
    pipeline = StableDiffusionPipeline(
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        unet=unet,
        scheduler=DDPMScheduler(**SCHEDULER_CONFIG),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    pipeline.save_pretrained(PRETRAINED)
    return {"vocab_size": len(vocab), "merges": len(merges)}


# ---------------------------------------------------------------------------------------------
# diffusers text-to-image (train_text_to_image.py --use_ema / train_text_to_image_lora.py)
# ---------------------------------------------------------------------------------------------

T2I_ARGS = dict(
    train_batch_size=2,
    gradient_accumulation_steps=2,
    learning_rate=1e-2,  # the scripts default to 1e-4; larger here so that a few steps move the weights visibly
    adam_beta1=0.9,
    adam_beta2=0.999,
    adam_weight_decay=1e-2,
    adam_epsilon=1e-8,
    max_grad_norm=1.0,
    lr_scheduler="constant",
    lr_warmup_steps=0,
    checkpointing_steps=2,
    mixed_precision="no",
    num_train_samples=12,  # 6 micro-batches of 2 per epoch -> 3 optimizer steps per epoch
    resolution=8,
    seed=SEED,
)
T2I_SET_ARGS = {
    "diffusers-t2i-ema": dict(use_ema=True, max_train_steps=8, checkpoints_total_limit=3),
    "diffusers-t2i-lora": dict(rank=2, max_train_steps=6, checkpoints_total_limit=None),
}
LORA_TARGETS = ["to_k", "to_q", "to_v", "to_out.0"]


def t2i_data(tokenizer) -> list[dict]:
    """Random images in [-1, 1] (what the scripts' Normalize([0.5], [0.5]) gives) and random captions, tokenized as
    the scripts' tokenize_captions does."""
    import torch

    g = torch.Generator().manual_seed(SEED + 1)
    n, res = T2I_ARGS["num_train_samples"], T2I_ARGS["resolution"]
    images = torch.rand(n, 3, res, res, generator=g) * 2 - 1
    captions = [" ".join(WORDS[int(i)] for i in torch.randint(0, len(WORDS), (4,), generator=g)) for _ in range(n)]
    ids = tokenizer(
        captions, max_length=tokenizer.model_max_length, padding="max_length", truncation=True, return_tensors="pt"
    ).input_ids
    return [{"pixel_values": images[i], "input_ids": ids[i]} for i in range(n)]


def collate_fn(examples):
    import torch

    pixel_values = torch.stack([example["pixel_values"] for example in examples])
    pixel_values = pixel_values.to(memory_format=torch.contiguous_format).float()
    input_ids = torch.stack([example["input_ids"] for example in examples])
    return {"pixel_values": pixel_values, "input_ids": input_ids}


class T2IRun:
    """The scripts' objects up to accelerator.prepare and the hook registration, in the scripts' order; used by the
    training worker and (to check accelerator.load_state with the scripts' load hooks) by the oracle worker."""

    def __init__(self, set_name: str) -> None:
        import torch
        from accelerate import Accelerator
        from accelerate.utils import ProjectConfiguration, set_seed
        from diffusers import AutoencoderKL, DDPMScheduler, StableDiffusionPipeline, UNet2DConditionModel
        from diffusers.optimization import get_scheduler
        from diffusers.training_utils import EMAModel
        from transformers import CLIPTextModel, CLIPTokenizer

        self.set_name = set_name
        self.lora = SETS[set_name]["lora"]
        a = self.args = {**T2I_ARGS, **T2I_SET_ARGS[set_name]}
        logging_dir = Path(OUTPUT_DIR, "logs")
        accelerator_project_config = ProjectConfiguration(project_dir=OUTPUT_DIR, logging_dir=logging_dir)
        self.accelerator = accelerator = Accelerator(
            gradient_accumulation_steps=a["gradient_accumulation_steps"],
            mixed_precision=a["mixed_precision"],
            log_with=None,  # the scripts' --report_to (tensorboard by default): no tracker here
            project_config=accelerator_project_config,
        )
        set_seed(a["seed"])
        if accelerator.is_main_process:
            os.makedirs(OUTPUT_DIR, exist_ok=True)

        self.noise_scheduler = DDPMScheduler.from_pretrained(PRETRAINED, subfolder="scheduler")
        self.tokenizer = CLIPTokenizer.from_pretrained(PRETRAINED, subfolder="tokenizer")
        self.text_encoder = CLIPTextModel.from_pretrained(PRETRAINED, subfolder="text_encoder")
        self.vae = AutoencoderKL.from_pretrained(PRETRAINED, subfolder="vae")
        unet = UNet2DConditionModel.from_pretrained(PRETRAINED, subfolder="unet")
        weight_dtype = self.weight_dtype = torch.float32

        def unwrap_model(model):
            from diffusers.utils.torch_utils import is_compiled_module

            model = accelerator.unwrap_model(model)
            return model._orig_mod if is_compiled_module(model) else model

        self.unwrap_model = unwrap_model
        self.ema_unet = None
        if not self.lora:
            # train_text_to_image.py: freeze vae and text_encoder, unet trainable, EMA from a second unet copy
            self.vae.requires_grad_(False)
            self.text_encoder.requires_grad_(False)
            unet.train()
            ema_unet = UNet2DConditionModel.from_pretrained(PRETRAINED, subfolder="unet")
            ema_unet = EMAModel(
                ema_unet.parameters(), model_cls=UNet2DConditionModel, model_config=ema_unet.config, foreach=False
            )
            self.ema_unet = ema_unet

            def save_model_hook(models, weights, output_dir):
                if accelerator.is_main_process:
                    ema_unet.save_pretrained(os.path.join(output_dir, "unet_ema"))
                    for model in models:
                        model.save_pretrained(os.path.join(output_dir, "unet"))
                        weights.pop()  # so that accelerate does not save the model a second time

            def load_model_hook(models, input_dir):
                load_model = EMAModel.from_pretrained(
                    os.path.join(input_dir, "unet_ema"), UNet2DConditionModel, foreach=False
                )
                ema_unet.load_state_dict(load_model.state_dict())
                ema_unet.to(accelerator.device)
                del load_model
                for _ in range(len(models)):
                    model = models.pop()
                    load_model = UNet2DConditionModel.from_pretrained(input_dir, subfolder="unet")
                    model.register_to_config(**load_model.config)
                    model.load_state_dict(load_model.state_dict())
                    del load_model

            accelerator.register_save_state_pre_hook(save_model_hook)
            accelerator.register_load_state_pre_hook(load_model_hook)
            params = unet.parameters()
        else:
            # train_text_to_image_lora.py: everything frozen, a LoRA adapter on the unet's attention projections
            from peft import LoraConfig

            unet.requires_grad_(False)
            self.vae.requires_grad_(False)
            self.text_encoder.requires_grad_(False)
            self.lora_config = dict(
                r=a["rank"], lora_alpha=a["rank"], init_lora_weights="gaussian", target_modules=LORA_TARGETS
            )
            unet.to(accelerator.device, dtype=weight_dtype)
            self.vae.to(accelerator.device, dtype=weight_dtype)
            self.text_encoder.to(accelerator.device, dtype=weight_dtype)
            unet.add_adapter(LoraConfig(**self.lora_config))
            # a filter object, as in the script: the optimizer consumes it, so the script's later
            # clip_grad_norm_(lora_layers, ...) gets an empty iterator
            params = self.lora_layers = filter(lambda p: p.requires_grad, unet.parameters())

        self.optimizer = torch.optim.AdamW(
            params,
            lr=a["learning_rate"],
            betas=(a["adam_beta1"], a["adam_beta2"]),
            weight_decay=a["adam_weight_decay"],
            eps=a["adam_epsilon"],
        )
        self.train_dataset = t2i_data(self.tokenizer)
        train_dataloader = torch.utils.data.DataLoader(
            self.train_dataset, shuffle=True, collate_fn=collate_fn, batch_size=a["train_batch_size"], num_workers=0
        )

        if self.lora:
            from diffusers.utils import convert_unet_state_dict_to_peft
            from peft.utils import get_peft_model_state_dict, set_peft_model_state_dict

            def save_model_hook(models, weights, output_dir):
                if accelerator.is_main_process:
                    unet_lora_layers_to_save = None
                    for model in models:
                        if isinstance(model, type(unwrap_model(unet))):
                            unet_lora_layers_to_save = get_peft_model_state_dict(model)
                        else:
                            raise ValueError(f"Unexpected save model: {model.__class__}")
                        weights.pop()
                    StableDiffusionPipeline.save_lora_weights(
                        save_directory=output_dir, unet_lora_layers=unet_lora_layers_to_save, safe_serialization=True
                    )

            def load_model_hook(models, input_dir):
                unet_ = None
                while len(models) > 0:
                    model = models.pop()
                    if isinstance(model, type(unwrap_model(unet))):
                        unet_ = model
                    else:
                        raise ValueError(f"unexpected save model: {model.__class__}")
                lora_state_dict, _network_alphas = StableDiffusionPipeline.lora_state_dict(input_dir)
                unet_state_dict = {
                    k.replace("unet.", ""): v for k, v in lora_state_dict.items() if k.startswith("unet.")
                }
                unet_state_dict = convert_unet_state_dict_to_peft(unet_state_dict)
                incompatible = set_peft_model_state_dict(unet_, unet_state_dict, adapter_name="default")
                unexpected = getattr(incompatible, "unexpected_keys", None) if incompatible is not None else None
                if unexpected:
                    raise RuntimeError(f"unexpected LoRA keys: {unexpected}")

        # the scripts' scheduler arithmetic (PR 8312)
        num_warmup_steps_for_scheduler = a["lr_warmup_steps"] * accelerator.num_processes
        num_training_steps_for_scheduler = a["max_train_steps"] * accelerator.num_processes
        lr_scheduler = get_scheduler(
            a["lr_scheduler"],
            optimizer=self.optimizer,
            num_warmup_steps=num_warmup_steps_for_scheduler,
            num_training_steps=num_training_steps_for_scheduler,
        )
        self.unet, self.optimizer, self.train_dataloader, self.lr_scheduler = accelerator.prepare(
            unet, self.optimizer, train_dataloader, lr_scheduler
        )
        if self.lora:
            accelerator.register_save_state_pre_hook(save_model_hook)
            accelerator.register_load_state_pre_hook(load_model_hook)
        else:
            self.ema_unet.to(accelerator.device)
        self.text_encoder.to(accelerator.device, dtype=weight_dtype)
        self.vae.to(accelerator.device, dtype=weight_dtype)
        self.num_update_steps_per_epoch = math.ceil(len(self.train_dataloader) / a["gradient_accumulation_steps"])
        self.num_train_epochs = math.ceil(a["max_train_steps"] / self.num_update_steps_per_epoch)


def save_live(name: str, tensors: dict) -> None:
    from safetensors.torch import save_file

    Path(LIVE_DIR).mkdir(exist_ok=True)
    save_file({k: v.detach().clone().contiguous() for k, v in tensors.items()}, str(Path(LIVE_DIR) / name))


def t2i_worker(set_name: str, set_dir: Path) -> None:
    import torch
    import torch.nn.functional as F

    torch.use_deterministic_algorithms(True)
    base = write_pretrained(Path("_tokenizer_src"))
    shutil.rmtree("_tokenizer_src")
    run = T2IRun(set_name)
    a, accelerator = run.args, run.accelerator
    unet, optimizer, lr_scheduler, noise_scheduler = run.unet, run.optimizer, run.lr_scheduler, run.noise_scheduler
    vae, text_encoder, ema_unet = run.vae, run.text_encoder, run.ema_unet
    frozen_before = {
        "vae": {k: v.clone() for k, v in vae.state_dict().items()},
        "text_encoder": {k: v.clone() for k, v in text_encoder.state_dict().items()},
    }
    if run.lora:
        frozen_before["unet (base)"] = {
            k: v.clone() for k, v in run.unwrap_model(unet).state_dict().items() if "lora_" not in k
        }
    saves: list[dict] = []
    deletions: list[dict] = []
    global_step = micro = 0
    for epoch in range(run.num_train_epochs):
        unet.train()
        train_loss = 0.0
        for _step, batch in enumerate(run.train_dataloader):
            with accelerator.accumulate(unet):
                latents = vae.encode(batch["pixel_values"].to(dtype=run.weight_dtype)).latent_dist.sample()
                latents = latents * vae.config.scaling_factor
                noise = torch.randn_like(latents)
                bsz = latents.shape[0]
                timesteps = torch.randint(0, noise_scheduler.config.num_train_timesteps, (bsz,), device=latents.device)
                timesteps = timesteps.long()
                noisy_latents = noise_scheduler.add_noise(latents, noise, timesteps)
                encoder_hidden_states = text_encoder(batch["input_ids"], return_dict=False)[0]
                if noise_scheduler.config.prediction_type != "epsilon":
                    raise RuntimeError("the tiny scheduler predicts epsilon")
                target = noise
                model_pred = unet(noisy_latents, timesteps, encoder_hidden_states, return_dict=False)[0]
                loss = F.mse_loss(model_pred.float(), target.float(), reduction="mean")
                avg_loss = accelerator.gather(loss.repeat(a["train_batch_size"])).mean()
                train_loss += avg_loss.item() / a["gradient_accumulation_steps"]
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    params_to_clip = run.lora_layers if run.lora else unet.parameters()
                    accelerator.clip_grad_norm_(params_to_clip, a["max_grad_norm"])
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
            micro += 1
            if accelerator.sync_gradients:
                if ema_unet is not None:
                    ema_unet.step(unet.parameters())
                global_step += 1
                step_loss = train_loss
                train_loss = 0.0
                if global_step % a["checkpointing_steps"] == 0 and accelerator.is_main_process:
                    limit = a["checkpoints_total_limit"]
                    if limit is not None:
                        checkpoints = [d for d in os.listdir(OUTPUT_DIR) if d.startswith("checkpoint")]
                        checkpoints = sorted(checkpoints, key=lambda x: int(x.split("-")[1]))
                        if len(checkpoints) >= limit:
                            num_to_remove = len(checkpoints) - limit + 1
                            for removing in checkpoints[0:num_to_remove]:
                                shutil.rmtree(os.path.join(OUTPUT_DIR, removing))
                                deletions.append(
                                    {
                                        "removed": f"{OUTPUT_DIR}/{removing}",
                                        "before_saving": f"checkpoint-{global_step}",
                                    }
                                )
                    save_path = os.path.join(OUTPUT_DIR, f"checkpoint-{global_step}")
                    accelerator.save_state(save_path)
                    if run.lora:
                        from peft.utils import get_peft_model_state_dict

                        save_live(
                            f"checkpoint-{global_step}.lora.safetensors",
                            get_peft_model_state_dict(run.unwrap_model(unet)),
                        )
                    else:
                        save_live(f"checkpoint-{global_step}.unet.safetensors", run.unwrap_model(unet).state_dict())
                        names = [n for n, _ in run.unwrap_model(unet).named_parameters()]
                        save_live(
                            f"checkpoint-{global_step}.unet_ema.safetensors",
                            dict(zip(names, ema_unet.shadow_params, strict=True)),
                        )
                    saves.append(
                        {
                            "path": save_path,
                            "global_step": global_step,
                            "micro_batches": micro,
                            "epoch": epoch,
                            "accelerator.step": accelerator.step,
                            "train_loss": step_loss,
                            "lr": lr_scheduler.get_last_lr()[0],
                            **(
                                {
                                    "ema_optimization_step": ema_unet.optimization_step,
                                    "ema_cur_decay_value": ema_unet.cur_decay_value,
                                }
                                if ema_unet is not None
                                else {}
                            ),
                        }
                    )
            if global_step >= a["max_train_steps"]:
                break

    accelerator.wait_for_everyone()
    final: dict = {}
    if accelerator.is_main_process:
        if not run.lora:
            from diffusers import StableDiffusionPipeline

            unet = run.unwrap_model(unet)
            ema_unet.copy_to(unet.parameters())
            pipeline = StableDiffusionPipeline.from_pretrained(
                PRETRAINED, text_encoder=text_encoder, vae=vae, unet=unet
            )
            pipeline.save_pretrained(OUTPUT_DIR)
            final = {"ema_optimization_step": ema_unet.optimization_step, "global_step": global_step}
        else:
            from diffusers import StableDiffusionPipeline
            from diffusers.utils import convert_state_dict_to_diffusers
            from peft.utils import get_peft_model_state_dict

            unet = unet.to(torch.float32)
            unwrapped_unet = run.unwrap_model(unet)
            unet_lora_state_dict = convert_state_dict_to_diffusers(get_peft_model_state_dict(unwrapped_unet))
            StableDiffusionPipeline.save_lora_weights(
                save_directory=OUTPUT_DIR, unet_lora_layers=unet_lora_state_dict, safe_serialization=True
            )
            save_live("final.lora.safetensors", get_peft_model_state_dict(unwrapped_unet))
            final = {"global_step": global_step}
    accelerator.end_training()
    unchanged = {}
    for comp, before in frozen_before.items():
        if comp == "vae":
            after = vae.state_dict()
        elif comp == "text_encoder":
            after = text_encoder.state_dict()
        else:
            after = {k: v for k, v in run.unwrap_model(unet).state_dict().items() if "lora_" not in k}
            after = {k.replace(".base_layer", ""): v for k, v in after.items()}
            before = {k.replace(".base_layer", ""): v for k, v in before.items()}
        unchanged[comp] = before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
        if not unchanged[comp]:
            raise RuntimeError(f"{comp} changed during training although frozen")
    record = {
        "saves": saves,
        "deletions": deletions,
        "final": final,
        "frozen_unchanged": unchanged,
        "pretrained": base,
        "args": a,
        "num_train_epochs": run.num_train_epochs,
        "num_update_steps_per_epoch": run.num_update_steps_per_epoch,
        "len_train_dataloader": len(run.train_dataloader),
        "logs_dir_created": Path(OUTPUT_DIR, "logs").exists(),
        **({"lora_config": run.lora_config} if run.lora else {}),
    }
    Path(WORKER_RECORD).write_text(json.dumps(record))


# ---------------------------------------------------------------------------------------------
# accelerate with two models (generator + discriminator)
# ---------------------------------------------------------------------------------------------

TWO_ARGS = dict(
    batch_size=2,
    samples=12,  # 6 micro-batches per epoch -> 3 optimizer steps per epoch
    gradient_accumulation_steps=2,
    save_after=[2, 4, 6],
    lr=1e-2,
    weight_decay=0.01,
    noise_dim=4,
    data_dim=8,
    hidden=16,
)

try:
    import torch.nn as _nn
except ImportError:  # pragma: no cover - the producers' venv has torch
    _nn = None

if _nn is not None:

    class Generator(_nn.Module):
        def __init__(self, noise_dim: int = 4, hidden: int = 16, data_dim: int = 8) -> None:
            super().__init__()
            self.net = _nn.Sequential(_nn.Linear(noise_dim, hidden), _nn.ReLU(), _nn.Linear(hidden, data_dim))

        def forward(self, z):
            return self.net(z)

    class Discriminator(_nn.Module):
        def __init__(self, data_dim: int = 8, hidden: int = 16) -> None:
            super().__init__()
            self.net = _nn.Sequential(_nn.Linear(data_dim, hidden), _nn.LeakyReLU(0.2), _nn.Linear(hidden, 1))

        def forward(self, x):
            return self.net(x)


class TwoModelRun:
    """Accelerator, models, optimizers, schedulers and dataloader, prepared in one call."""

    def __init__(self) -> None:
        import torch
        from accelerate import Accelerator
        from accelerate.utils import ProjectConfiguration, set_seed

        a = TWO_ARGS
        set_seed(SEED)
        self.accelerator = Accelerator(
            gradient_accumulation_steps=a["gradient_accumulation_steps"],
            project_config=ProjectConfiguration(project_dir=OUTPUT_DIR, automatic_checkpoint_naming=True),
        )
        g = Generator(a["noise_dim"], a["hidden"], a["data_dim"])
        d = Discriminator(a["data_dim"], a["hidden"])
        opt_g = torch.optim.AdamW(g.parameters(), lr=a["lr"], weight_decay=a["weight_decay"], betas=(0.5, 0.999))
        opt_d = torch.optim.AdamW(d.parameters(), lr=a["lr"], weight_decay=a["weight_decay"], betas=(0.5, 0.999))
        sched_g = torch.optim.lr_scheduler.LinearLR(opt_g, start_factor=1.0, end_factor=0.5, total_iters=20)
        sched_d = torch.optim.lr_scheduler.LinearLR(opt_d, start_factor=1.0, end_factor=0.5, total_iters=20)
        gen = torch.Generator().manual_seed(SEED + 1)
        real = torch.randn(a["samples"], a["data_dim"], generator=gen) * 0.5 + 1.0
        dl = torch.utils.data.DataLoader(real, batch_size=a["batch_size"], shuffle=False)
        (self.g, self.d, self.opt_g, self.opt_d, self.sched_g, self.sched_d, self.dl) = self.accelerator.prepare(
            g, d, opt_g, opt_d, sched_g, sched_d, dl
        )


def two_models_worker(set_name: str, set_dir: Path) -> None:
    import torch
    import torch.nn.functional as F

    torch.use_deterministic_algorithms(True)
    run = TwoModelRun()
    acc, g, d = run.accelerator, run.g, run.d
    a = TWO_ARGS
    saves = []
    opt_step = micro = epoch = 0
    last = max(a["save_after"])
    while opt_step < last:
        for real in run.dl:
            micro += 1
            with acc.accumulate(g, d):
                z = torch.randn(real.shape[0], a["noise_dim"])
                fake = g(z)
                ones = torch.ones(real.shape[0], 1)
                zeros = torch.zeros(real.shape[0], 1)
                d_loss = F.binary_cross_entropy_with_logits(d(real), ones) + F.binary_cross_entropy_with_logits(
                    d(fake.detach()), zeros
                )
                acc.backward(d_loss)
                run.opt_d.step()
                run.sched_d.step()
                run.opt_d.zero_grad()
                d.requires_grad_(False)  # the generator's loss must not reach the discriminator's gradients
                g_loss = F.binary_cross_entropy_with_logits(d(fake), ones)
                acc.backward(g_loss)
                d.requires_grad_(True)
                run.opt_g.step()
                run.sched_g.step()
                run.opt_g.zero_grad()
            if acc.sync_gradients:
                opt_step += 1
                if opt_step in a["save_after"]:
                    loc = acc.save_state()
                    name = Path(loc).name
                    odir = Path("oracle")
                    for key, model in (("model", g), ("model_1", d)):
                        write_oracle(
                            odir / f"{name}.{key}.safetensors",
                            acc.unwrap_model(model).state_dict(),
                            f"{type(acc.unwrap_model(model)).__name__}.state_dict() right after save_state",
                        )
                    saves.append(
                        {
                            "path": os.path.relpath(loc, "."),
                            "optimizer_step": opt_step,
                            "micro_batches": micro,
                            "epoch": epoch,
                            "accelerator.step": acc.step,
                            "save_iteration": acc.save_iteration - 1,
                            "d_loss": float(d_loss.detach()),
                            "g_loss": float(g_loss.detach()),
                        }
                    )
                if opt_step >= last:
                    break
        epoch += 1
    acc.end_training()
    Path(WORKER_RECORD).write_text(json.dumps({"saves": saves, "args": a}))


# ---------------------------------------------------------------------------------------------
# Oracles (a second process)
# ---------------------------------------------------------------------------------------------


def _same(a: dict, b: dict) -> bool:
    import torch

    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _max_diff(a: dict, b: dict) -> float:
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def _files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())


def _accelerate_files(ck: Path) -> dict:
    """The counters accelerate's own files record."""
    import torch

    out: dict = {}
    for opt in sorted(ck.glob("optimizer*.bin")):
        sd = torch.load(opt, map_location="cpu", weights_only=True)
        out[f"{opt.name} step"] = optimizer_steps(sd)
        out[f"{opt.name} state entries"] = len(sd["state"])
    for sch in sorted(ck.glob("scheduler*.bin")):
        sd = torch.load(sch, map_location="cpu", weights_only=True)
        out[f"{sch.name}"] = {"last_epoch": sd.get("last_epoch"), "_step_count": sd.get("_step_count")}
    for rng in sorted(ck.glob("random_states_*.pkl")):
        out[f"{rng.name} step"] = torch.load(rng, map_location="cpu", weights_only=False)["step"]
    return out


def t2i_oracle(set_name: str, set_dir: Path) -> None:
    from safetensors.torch import load_file

    record = json.loads(Path(WORKER_RECORD).read_text())
    lora = SETS[set_name]["lora"]
    odir = Path("oracle")
    out: dict = {"checkpoints": {}}
    remaining = sorted(
        (p for p in Path(OUTPUT_DIR).iterdir() if p.is_dir() and p.name.startswith("checkpoint-")),
        key=lambda p: int(p.name.split("-")[1]),
    )
    saves = {s["path"]: s for s in record["saves"]}
    if lora:
        from diffusers import StableDiffusionPipeline
        from peft.utils import get_peft_model_state_dict

        for ck in remaining:
            sd = load_file(ck / "pytorch_lora_weights.safetensors")
            target = odir / f"{ck.name}.safetensors"
            write_oracle(target, sd, "safetensors.torch.load_file(pytorch_lora_weights.safetensors)")
            live = load_file(Path(LIVE_DIR) / f"{ck.name}.lora.safetensors")
            if not _same({f"unet.{k}": v for k, v in live.items()}, sd):
                raise RuntimeError(
                    f"{ck}: pytorch_lora_weights.safetensors != 'unet.' + get_peft_model_state_dict(unet)"
                )
            # diffusers' own loading: the base pipeline + load_lora_weights(checkpoint folder)
            pipe = StableDiffusionPipeline.from_pretrained(PRETRAINED)
            pipe.load_lora_weights(str(ck))
            got = get_peft_model_state_dict(pipe.unet, adapter_name=pipe.unet.active_adapters()[0])
            if not _same(got, live):
                raise RuntimeError(f"{ck}: load_lora_weights does not give back the trained adapter")
            adapter_name = pipe.unet.active_adapters()[0]
            del pipe
            s = saves[str(ck)]
            out["checkpoints"][str(ck)] = {
                "optimizer_step": s["global_step"],
                "source": "global_step of the script's loop (optimizer steps: accelerator.sync_gradients)",
                "micro_batches": s["micro_batches"],
                "epoch": s["epoch"],
                "accelerator.step_at_save": s["accelerator.step"],
                "name_counts": "optimizer steps (global_step)",
                "files": _files(ck),
                "components": {
                    "pytorch_lora_weights.safetensors": "the LoRA adapter of the unet (trained; the unet itself is "
                    "frozen and not saved), written by the script's save hook: "
                    "StableDiffusionPipeline.save_lora_weights(unet_lora_layers=get_peft_model_state_dict(unet))",
                    "optimizer.bin": "AdamW state of the LoRA parameters only, keyed by index",
                    "scheduler.bin": "the constant LR schedule (LambdaLR)",
                    "random_states_0.pkl": "RNG states",
                },
                "oracle": str(target),
                "oracle_tool": "safetensors.torch.load_file(checkpoint/pytorch_lora_weights.safetensors)",
                "oracle_keys": list(sd.keys()),
                "key_format": "unet.<module>.lora_A.weight / lora_B.weight (peft names, 'unet.' prefix; no "
                "adapter name)",
                "checked": [
                    "equals 'unet.' + get_peft_model_state_dict(unet) of the live model at the save",
                    f"StableDiffusionPipeline.from_pretrained('{PRETRAINED}').load_lora_weights(checkpoint) gives "
                    f"exactly these LoRA weights (adapter name {adapter_name!r})",
                ],
                **_accelerate_files(ck),
            }
        final_file = Path(OUTPUT_DIR, "pytorch_lora_weights.safetensors")
        final_sd = load_file(final_file)
        pipe = StableDiffusionPipeline.from_pretrained(PRETRAINED)
        pipe.load_lora_weights(OUTPUT_DIR)
        live_final = load_file(Path(LIVE_DIR) / "final.lora.safetensors")
        got = get_peft_model_state_dict(pipe.unet, adapter_name=pipe.unet.active_adapters()[0])
        if not _same(got, live_final):
            raise RuntimeError("final pytorch_lora_weights.safetensors: load_lora_weights != trained adapter")
        last_ck = remaining[-1]
        same_as_last = _same(
            {k: v for k, v in load_file(last_ck / "pytorch_lora_weights.safetensors").items()},
            {f"unet.{k}": v for k, v in live_final.items()},
        )
        out["final_export"] = {
            "path": str(final_file),
            "what": "the script's final save: StableDiffusionPipeline.save_lora_weights(output_dir, "
            "unet_lora_layers=convert_state_dict_to_diffusers(get_peft_model_state_dict(unet)))",
            "keys": list(final_sd.keys()),
            "key_format": "unet.<module>.lora.down.weight / lora.up.weight (convert_state_dict_to_diffusers: "
            "lora_A -> lora.down, lora_B -> lora.up): NOT the key names of the checkpoints' files",
            "optimizer_step": record["final"]["global_step"],
            "same_weights_as": str(last_ck) if same_as_last else None,
            "checked": f"StableDiffusionPipeline.from_pretrained('{PRETRAINED}').load_lora_weights('{OUTPUT_DIR}') "
            "gives the trained adapter",
        }
        # the frozen base unet, for applying the adapters without diffusers
        base = load_file(Path(PRETRAINED, "unet", "diffusion_pytorch_model.safetensors"))
        write_oracle(odir / "base_unet.safetensors", base, f"{PRETRAINED}/unet/diffusion_pytorch_model.safetensors")
        out["base_oracle"] = str(odir / "base_unet.safetensors")
    else:
        from diffusers import UNet2DConditionModel
        from diffusers.training_utils import EMAModel

        for ck in remaining:
            s = saves[str(ck)]
            unet_sd = UNet2DConditionModel.from_pretrained(ck / "unet").state_dict()
            t_unet = odir / f"{ck.name}.unet.safetensors"
            write_oracle(t_unet, unet_sd, "UNet2DConditionModel.from_pretrained(checkpoint/unet).state_dict()")
            ema = EMAModel.from_pretrained(ck / "unet_ema", UNet2DConditionModel)
            holder = UNet2DConditionModel.from_config(ema.model_config)
            ema.copy_to(holder.parameters())
            ema_sd = holder.state_dict()
            direct = UNet2DConditionModel.from_pretrained(ck / "unet_ema").state_dict()
            if not _same(ema_sd, direct):
                raise RuntimeError(f"{ck}: EMAModel.from_pretrained != UNet2DConditionModel.from_pretrained(unet_ema)")
            t_ema = odir / f"{ck.name}.unet_ema.safetensors"
            write_oracle(
                t_ema,
                ema_sd,
                "EMAModel.from_pretrained(checkpoint/unet_ema, UNet2DConditionModel).copy_to(unet.parameters()); "
                "unet.state_dict()",
            )
            live_unet = load_file(Path(LIVE_DIR) / f"{ck.name}.unet.safetensors")
            live_ema = load_file(Path(LIVE_DIR) / f"{ck.name}.unet_ema.safetensors")
            if not _same(unet_sd, live_unet) or not _same(ema_sd, live_ema):
                raise RuntimeError(f"{ck}: saved unet / unet_ema differ from the live weights at the save")
            ema_cfg = json.loads((ck / "unet_ema" / "config.json").read_text())
            ema_keys = (
                "decay",
                "min_decay",
                "optimization_step",
                "update_after_step",
                "use_ema_warmup",
                "inv_gamma",
                "power",
            )
            if ema.optimization_step != s["global_step"]:
                raise RuntimeError(f"{ck}: EMA optimization_step {ema.optimization_step} != {s['global_step']}")
            out["checkpoints"][str(ck)] = {
                "optimizer_step": s["global_step"],
                "source": "global_step of the script's loop (optimizer steps: accelerator.sync_gradients)",
                "micro_batches": s["micro_batches"],
                "epoch": s["epoch"],
                "accelerator.step_at_save": s["accelerator.step"],
                "name_counts": "optimizer steps (global_step)",
                "oracle": str(t_unet),
                "oracle_ema": str(t_ema),
                "files": _files(ck),
                "components": {
                    "unet": {
                        "what": "the trained unet (model.save_pretrained in the script's save hook; accelerate's own "
                        "model.safetensors is not written: the hook pops the weights)",
                        "kind": "trained",
                        "oracle": str(t_unet),
                        "oracle_tool": "UNet2DConditionModel.from_pretrained(checkpoint/unet).state_dict()",
                    },
                    "unet_ema": {
                        "what": "an EMA of the unet kept by the trainer (diffusers EMAModel, saved by "
                        "EMAModel.save_pretrained: a UNet2DConditionModel folder whose config.json also records the "
                        "EMA's state)",
                        "kind": "ema",
                        "oracle": str(t_ema),
                        "oracle_tool": "EMAModel.from_pretrained(checkpoint/unet_ema, UNet2DConditionModel), "
                        "copy_to(unet.parameters()), unet.state_dict(); checked equal to "
                        "UNet2DConditionModel.from_pretrained(checkpoint/unet_ema).state_dict()",
                        "ema_state_in_config_json": {k: ema_cfg.get(k) for k in ema_keys},
                        "decay_used_at_last_update": s["ema_cur_decay_value"],
                        "max_abs_diff_to_unet": _max_diff(ema_sd, unet_sd),
                    },
                    "optimizer.bin": "AdamW state of the unet parameters, keyed by index",
                    "scheduler.bin": "the constant LR schedule (LambdaLR)",
                    "random_states_0.pkl": "RNG states",
                },
                "checked": "the saved unet and unet_ema equal the live unet parameters and EMAModel.shadow_params "
                "at the save",
                **_accelerate_files(ck),
            }
        # the script's final export: a whole pipeline in output_dir, its unet = the EMA at the last step
        export_unet = UNet2DConditionModel.from_pretrained(Path(OUTPUT_DIR, "unet")).state_dict()
        last_ck = remaining[-1]
        last_ema = load_file(odir / f"{last_ck.name}.unet_ema.safetensors")
        if record["final"]["ema_optimization_step"] != int(last_ck.name.split("-")[1]) or not _same(
            export_unet, last_ema
        ):
            raise RuntimeError("the exported pipeline's unet is not the EMA of the last checkpoint")
        from diffusers import StableDiffusionPipeline

        pipe = StableDiffusionPipeline.from_pretrained(OUTPUT_DIR)
        base_pipe = StableDiffusionPipeline.from_pretrained(PRETRAINED)
        if not _same(pipe.vae.state_dict(), base_pipe.vae.state_dict()) or not _same(
            pipe.text_encoder.state_dict(), base_pipe.text_encoder.state_dict()
        ):
            raise RuntimeError("exported vae / text_encoder differ from the pretrained ones (they are frozen)")
        if not _same(pipe.unet.state_dict(), last_ema):
            raise RuntimeError("StableDiffusionPipeline.from_pretrained(output_dir).unet != EMA at the last step")
        out["final_export"] = {
            "path": OUTPUT_DIR,
            "what": "the script's final save: ema_unet.copy_to(unet.parameters()), "
            "StableDiffusionPipeline.from_pretrained(pretrained, text_encoder=, vae=, unet=), "
            "pipeline.save_pretrained(output_dir), beside the checkpoint-N folders",
            "files": sorted(
                str(p.relative_to(OUTPUT_DIR))
                for p in Path(OUTPUT_DIR).rglob("*")
                if p.is_file() and not p.relative_to(OUTPUT_DIR).parts[0].startswith("checkpoint-")
            ),
            "model_index.json": json.loads(Path(OUTPUT_DIR, "model_index.json").read_text()),
            "components": {
                "unet": f"the trainer's EMA at optimizer step {record['final']['global_step']} (EMAModel "
                f"optimization_step {record['final']['ema_optimization_step']}); equal to "
                f"oracle/{last_ck.name}.unet_ema.safetensors",
                "vae": "frozen: the pretrained weights",
                "text_encoder": "frozen: the pretrained weights",
                "tokenizer": "the pretrained tokenizer (tokenizer.json + tokenizer_config.json)",
                "scheduler": "DDPMScheduler config",
            },
            "optimizer_step": record["final"]["global_step"],
            "unet_equals_ema_of": str(last_ck),
            "checked": "StableDiffusionPipeline.from_pretrained(output_dir): unet == the EMA of the last checkpoint, "
            "vae and text_encoder == pretrained",
        }
    # accelerate's own loading: a fresh run (same construction) and accelerator.load_state with the scripts' hooks
    checks = []
    run = T2IRun(set_name)
    for ck in remaining:
        run.accelerator.load_state(str(ck))
        unwrapped = run.unwrap_model(run.unet)
        opt_steps = optimizer_steps(run.optimizer.state_dict())
        if lora:
            from peft.utils import get_peft_model_state_dict

            live = load_file(Path(LIVE_DIR) / f"{ck.name}.lora.safetensors")
            ok = _same(get_peft_model_state_dict(unwrapped), live)
        else:
            names = [n for n, _ in unwrapped.named_parameters()]
            ok = _same(unwrapped.state_dict(), load_file(odir / f"{ck.name}.unet.safetensors")) and _same(
                dict(zip(names, run.ema_unet.shadow_params, strict=True)),
                load_file(odir / f"{ck.name}.unet_ema.safetensors"),
            )
            ok = ok and run.ema_unet.optimization_step == int(ck.name.split("-")[1])
        step = int(ck.name.split("-")[1])
        if not ok or opt_steps != [float(step)]:
            raise RuntimeError(f"{ck}: accelerator.load_state does not restore the saved state ({opt_steps})")
        checks.append(str(ck))
    out["load_state_checked"] = checks
    Path(ORACLE_RECORD).write_text(json.dumps(out))


def two_models_oracle(set_name: str, set_dir: Path) -> None:
    from safetensors.torch import load_file

    record = json.loads(Path(WORKER_RECORD).read_text())
    out: dict = {"checkpoints": {}}
    run = TwoModelRun()
    for s in record["saves"]:
        ck = Path(s["path"])
        name = ck.name
        run.accelerator.load_state(str(ck))
        entry_models = {}
        for key, model, opt_name in (("model", run.g, "optimizer.bin"), ("model_1", run.d, "optimizer_1.bin")):
            oracle = Path("oracle") / f"{name}.{key}.safetensors"
            want = load_file(oracle)
            restored = run.accelerator.unwrap_model(model).state_dict()
            in_file = load_file(ck / f"{key}.safetensors")
            if not _same(restored, want) or not _same(in_file, want):
                raise RuntimeError(f"{ck}: {key}: load_state / {key}.safetensors != state_dict() at the save")
            entry_models[key] = {
                "what": f"{type(run.accelerator.unwrap_model(model)).__name__} (index {0 if key == 'model' else 1} "
                "in accelerator.prepare)",
                "kind": "trained",
                "weights_file": f"{key}.safetensors",
                "optimizer_file": opt_name,
                "scheduler_file": "scheduler.bin" if key == "model" else "scheduler_1.bin",
                "oracle": str(oracle),
                "oracle_tool": "the model's state_dict() right after save_state; checked: Accelerator.load_state "
                f"restores it and safetensors.torch.load_file({key}.safetensors) equals it",
                "oracle_keys": list(want.keys()),
            }
        steps = _accelerate_files(ck)
        for opt in ("optimizer.bin", "optimizer_1.bin"):
            if steps[f"{opt} step"] != [float(s["optimizer_step"])]:
                raise RuntimeError(f"{ck}: {opt} step {steps[f'{opt} step']} != {s['optimizer_step']}")
        out["checkpoints"][str(ck)] = {
            "optimizer_step": s["optimizer_step"],
            "source": "optimizer steps counted by the loop (accelerator.sync_gradients)",
            "micro_batches": s["micro_batches"],
            "epoch": s["epoch"],
            "save_iteration": s["save_iteration"],
            "name_counts": "saves (automatic_checkpoint_naming: checkpoint_<save_iteration>)",
            "accelerator.step_at_save": s["accelerator.step"],
            "oracle": entry_models["model"]["oracle"],
            "oracle_model_1": entry_models["model_1"]["oracle"],
            "files": _files(ck),
            "components": entry_models,
            **steps,
        }
    Path(ORACLE_RECORD).write_text(json.dumps(out))


def oracle_worker(set_name: str, set_dir: Path) -> None:
    if SETS[set_name]["kind"] == "t2i":
        t2i_oracle(set_name, set_dir)
    else:
        two_models_oracle(set_name, set_dir)


# ---------------------------------------------------------------------------------------------
# producer.json
# ---------------------------------------------------------------------------------------------


def set_notes(set_name: str, record: dict) -> list[str]:
    if set_name == "accelerate-two-models":
        a = record["args"]
        return [
            "accelerate without a distributed backend (1 CPU process), Accelerator(gradient_accumulation_steps=2, "
            "project_config=ProjectConfiguration(project_dir='ckpts', automatic_checkpoint_naming=True)); "
            "accelerator.prepare(generator, discriminator, opt_g, opt_d, sched_g, sched_d, dataloader).",
            "save_state() after optimizer steps "
            + ", ".join(map(str, a["save_after"]))
            + " -> ckpts/checkpoints/checkpoint_<i>, i = 0, 1, 2 counting saves, not steps. Files are numbered by "
            "the order of prepare(): model.safetensors / optimizer.bin / scheduler.bin for the first model, "
            "model_1.safetensors / optimizer_1.bin / scheduler_1.bin for the second; random_states_0.pkl is the "
            "process's RNG state (its 'step' is Accelerator.step: micro-batches since the dataloader epoch began, "
            "reset to 0 on the epoch's last batch: "
            + ", ".join(str(s["accelerator.step"]) for s in record["saves"])
            + " at the saves).",
            f"A GAN-style step on random data: {a['samples']} real samples, batch {a['batch_size']}, no shuffling, "
            f"{a['samples'] // a['batch_size']} micro-batches per epoch, gradient accumulation "
            f"{a['gradient_accumulation_steps']} under accelerator.accumulate(g, d); discriminator "
            "BCE on real/fake, then the generator's BCE through the discriminator with the discriminator's "
            "requires_grad off. AdamW(lr=1e-2, betas=(0.5, 0.999), weight_decay=0.01) for each model, LinearLR "
            "(1.0 -> 0.5 over 20) for each optimizer (AcceleratedScheduler steps it once per optimizer step here: "
            "1 process).",
            "oracle/<checkpoint>.model.safetensors and .model_1.safetensors: each model's state_dict() right after "
            "save_state; a fresh run's Accelerator.load_state(checkpoint) was checked to restore exactly these, and "
            "model.safetensors / model_1.safetensors hold the same tensors under the same keys.",
            "No CPU patch.",
        ]
    a = record["args"]
    common = [
        f"1 CPU process, mixed_precision='no' (float32), Accelerator(gradient_accumulation_steps="
        f"{a['gradient_accumulation_steps']}, project_config=ProjectConfiguration(project_dir='ckpts', "
        "logging_dir=ckpts/logs)), no tracker (log_with=None; the scripts default to tensorboard): no logs/ folder "
        f"is written. train_batch_size {a['train_batch_size']}, {a['num_train_samples']} samples, shuffle=True "
        f"(set_seed({SEED})), {record['len_train_dataloader']} micro-batches per epoch, "
        f"{record['num_update_steps_per_epoch']} optimizer steps per epoch, {record['num_train_epochs']} epochs for "
        f"max_train_steps={a['max_train_steps']}.",
        f"{PRETRAINED}/ is the scripts' --pretrained_model_name_or_path: random tiny components (torch.manual_seed("
        f"{SEED})) written by StableDiffusionPipeline.save_pretrained (no safety checker / feature extractor; "
        "tokenizer: CLIPTokenizer.from_pretrained of a vocab.json/merges.txt written by this script, saved by "
        "transformers 5 as tokenizer.json + tokenizer_config.json only), read back with from_pretrained(..., "
        "subfolder=...) exactly as the scripts do.",
        "The training step is the scripts': vae.encode(pixel_values).latent_dist.sample() * scaling_factor, "
        "noise, random timesteps, DDPMScheduler.add_noise, CLIPTextModel hidden states, unet noise prediction, "
        "MSE against the noise (epsilon), accelerator.backward, clip_grad_norm_ on sync, optimizer/lr_scheduler "
        f"step. AdamW(lr={a['learning_rate']}, betas=({a['adam_beta1']}, {a['adam_beta2']}), weight_decay="
        f"{a['adam_weight_decay']}, eps={a['adam_epsilon']}); get_scheduler('constant'). Random images in [-1, 1] "
        "and random captions stand in for the dataset.",
        "checkpoint-N counts optimizer steps (the loop's global_step, incremented when accelerator.sync_gradients). "
        "random_states_0.pkl 'step' is Accelerator.step (micro-batches in the current dataloader epoch, 0 at the "
        "end of an epoch); scheduler.bin's last_epoch counts lr_scheduler.step() calls that were not skipped.",
    ]
    if set_name == "diffusers-t2i-ema":
        dels = ", ".join(f"{d['removed']} (before saving {d['before_saving']})" for d in record["deletions"])
        return [
            "diffusers examples/text_to_image/train_text_to_image.py --use_ema: vae and text_encoder frozen, the "
            "unet trains; EMAModel(<second unet from pretrained>.parameters(), model_cls=UNet2DConditionModel, "
            "model_config=...config) with its defaults (decay 0.9999, update_after_step 0, no warmup: decay "
            "(1 + s) / (10 + s) with s = optimization_step - 1, 0 at the first update), "
            "ema_unet.step(unet.parameters()) after every optimizer step.",
            "The script's save hook (register_save_state_pre_hook): ema_unet.save_pretrained(<ckpt>/unet_ema), "
            "model.save_pretrained(<ckpt>/unet), weights.pop(): accelerate then writes no model.safetensors, only "
            "optimizer.bin, scheduler.bin and random_states_0.pkl. The load hook (EMAModel.from_pretrained + "
            "UNet2DConditionModel.from_pretrained) was used to check Accelerator.load_state of every checkpoint.",
            "unet_ema/config.json is the unet's config plus the EMA's state registered into it: decay, min_decay, "
            "optimization_step (= the optimizer step), update_after_step, use_ema_warmup, inv_gamma, power; "
            "unet/config.json records no step.",
            f"checkpointing_steps={a['checkpointing_steps']}, checkpoints_total_limit={a['checkpoints_total_limit']}: "
            f"the script's own deletion before each save removed {dels}.",
            "At the end the script copies the EMA into the unet and saves the whole pipeline into output_dir "
            "(ckpts/): model_index.json, unet/, vae/, text_encoder/, tokenizer/, scheduler/ beside checkpoint-N/.",
            *common,
            "No CPU patch.",
        ]
    return [
        "diffusers examples/text_to_image/train_text_to_image_lora.py: unet, vae, text_encoder frozen; "
        f"unet.add_adapter(LoraConfig(r={a['rank']}, lora_alpha={a['rank']}, init_lora_weights='gaussian', "
        f"target_modules={LORA_TARGETS})); AdamW over the LoRA parameters only.",
        "The script's save hook: StableDiffusionPipeline.save_lora_weights(save_directory=<ckpt>, "
        "unet_lora_layers=get_peft_model_state_dict(unet), safe_serialization=True), weights.pop(): each "
        "checkpoint-N holds pytorch_lora_weights.safetensors (keys 'unet.' + peft names: ...lora_A.weight / "
        "...lora_B.weight), optimizer.bin, scheduler.bin, random_states_0.pkl, and no model file.",
        "The final save (after the loop) converts first: convert_state_dict_to_diffusers(get_peft_model_state_dict"
        "(unet)) -> ckpts/pytorch_lora_weights.safetensors with keys ...lora.down.weight / ...lora.up.weight. "
        "The same LoRA weights under different key names from the checkpoints'; load_lora_weights reads both.",
        "The script's clip_grad_norm_(lora_layers, ...) gets the filter object the optimizer already consumed: "
        "nothing is clipped (reproduced as is).",
        f"oracle/checkpoint-N.safetensors: load_file of the checkpoint's pytorch_lora_weights.safetensors. "
        f"oracle/base_unet.safetensors: the frozen base unet ({PRETRAINED}/unet). diffusers loads the adapters "
        f"back with StableDiffusionPipeline.from_pretrained('{PRETRAINED}').load_lora_weights(<folder>) (checked "
        "for every checkpoint and for ckpts/ itself), and the script's load hook (lora_state_dict, "
        "convert_unet_state_dict_to_peft, set_peft_model_state_dict) with Accelerator.load_state.",
        f"checkpointing_steps={a['checkpointing_steps']}, no checkpoints_total_limit.",
        *common,
        "No CPU patch.",
    ]


def versions(kind: str) -> dict:
    names = (
        ["accelerate", "numpy"]
        if kind == "two_models"
        else ["diffusers", "accelerate", "transformers", "peft", "tokenizers", "huggingface-hub", "numpy"]
    )
    return package_versions(names)


# ---------------------------------------------------------------------------------------------
# Launching
# ---------------------------------------------------------------------------------------------


def launch(set_name: str, set_dir: Path, worker: str, timeout: float = 900) -> None:
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARS}
    env.update(
        OMP_NUM_THREADS="1",
        PYTHONWARNINGS="ignore",
        CUDA_VISIBLE_DEVICES="",
        PYTHONHASHSEED="0",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_HUB_DISABLE_TELEMETRY="1",
        TOKENIZERS_PARALLELISM="false",
        ACCELERATE_DISABLE_RICH="1",
    )
    cmd = [sys.executable, str(THIS), "--worker", worker, "--set", set_name, "--set-dir", str(set_dir)]
    run_worker(cmd, env=env, cwd=set_dir, label=f"{set_name}/{worker}", timeout=timeout)


def produce(set_name: str, out: Path) -> Path:
    spec = SETS[set_name]
    kind = spec["kind"]
    set_dir = fresh_set_dir(out, set_name)
    t0 = time.time()
    launch(set_name, set_dir, kind)
    launch(set_name, set_dir, "oracle")
    record = json.loads((set_dir / WORKER_RECORD).read_text())
    oracle = json.loads((set_dir / ORACLE_RECORD).read_text())
    for name in (WORKER_RECORD, ORACLE_RECORD):
        (set_dir / name).unlink()
    shutil.rmtree(set_dir / LIVE_DIR, ignore_errors=True)
    checkpoints = oracle.pop("checkpoints")
    if len(checkpoints) < 3:
        raise RuntimeError(f"{set_name}: only {len(checkpoints)} checkpoints: {sorted(checkpoints)}")
    producer: dict = {
        "set": set_name,
        "versions": versions(kind),
        "command": f".venv-fixtures/bin/python {SCRIPT_REL} --out tests/fixtures/trainers --set {set_name}  (runs "
        f"{SCRIPT_REL} --worker {kind}, then --worker oracle, each one process with cwd = the set folder)",
        "env": {"OMP_NUM_THREADS": "1"},
        "world_size": 1,
        "seed": SEED,
        "cpu_patches": [],
    }
    if kind == "t2i":
        producer.update(
            {
                "script": "diffusers examples/text_to_image/"
                + ("train_text_to_image_lora.py" if spec["lora"] else "train_text_to_image.py --use_ema"),
                "args": record["args"],
                **({"lora_config": record["lora_config"]} if spec["lora"] else {}),
                "pretrained": {
                    "path": PRETRAINED,
                    "unet_config": UNET_CONFIG,
                    "vae_config": VAE_CONFIG,
                    "text_encoder_config": text_encoder_config(tokenizer_vocab()[0]),
                    "scheduler_config": SCHEDULER_CONFIG,
                    "tokenizer": {"model_max_length": TOKENIZER_MAX_LENGTH, **record["pretrained"]},
                },
                "frozen_unchanged": record["frozen_unchanged"],
                "deleted_checkpoints": record["deletions"],
            }
        )
    else:
        producer.update(
            {
                "args": record["args"],
                "models": {
                    "model": "Generator: Sequential(Linear(4, 16), ReLU, Linear(16, 8))",
                    "model_1": "Discriminator: Sequential(Linear(8, 16), LeakyReLU(0.2), Linear(16, 1))",
                },
            }
        )
    producer["checkpoints"] = checkpoints
    producer.update(oracle)
    producer["notes"] = set_notes(set_name, record)
    (set_dir / "producer.json").write_text(json.dumps(producer, indent=2) + "\n")
    size = sum(p.stat().st_size for p in set_dir.rglob("*") if p.is_file())
    print(f"[{set_name}] {len(checkpoints)} checkpoints, {size} bytes, {time.time() - t0:.0f} s", flush=True)
    return set_dir


WORKERS = {"t2i": t2i_worker, "two_models": two_models_worker, "oracle": oracle_worker}


def main(argv: list[str] | None = None) -> int:
    return run_producer(__doc__.splitlines()[0], SETS, WORKERS, produce, argv)


if __name__ == "__main__":
    sys.exit(main())
