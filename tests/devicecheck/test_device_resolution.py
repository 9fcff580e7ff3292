"""``device=auto`` resolved and why (runtime/device.py), and a resume reading its checkpoint into
host memory whatever the run's device (train/checkpoint.py resume_from)."""

from __future__ import annotations

import torch

from echotrain.runtime.device import resolve_device, resolve_device_why


def test_auto_without_a_gpu_is_the_cpu_and_says_why(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", None)
    assert resolve_device_why("auto") == (torch.device("cpu"),
                                          "device=auto and this torch build has no CUDA (a CPU wheel)")
    assert resolve_device_why("cpu") == (torch.device("cpu"), "device=cpu is set")
    assert resolve_device("cuda:1") == torch.device("cuda", 1)


def test_auto_picks_a_visible_gpu_and_names_it(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "NVIDIA H200")
    assert resolve_device_why("auto") == (torch.device("cuda"), "device=auto and a CUDA GPU is visible (NVIDIA H200)")


def test_auto_on_a_cuda_build_without_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    assert resolve_device_why("auto")[1] == "device=auto and no CUDA GPU is visible (driver / CUDA_VISIBLE_DEVICES)"


def test_rng_devices_forks_the_cuda_generator_of_the_run(monkeypatch):
    """fork_rng(devices=...) for a device: its CUDA index (the current one for a bare cuda), none
    off CUDA (the trainer's evaluations fork it, so their torch.manual_seed leaves the run's
    CUDA stream alone)."""
    from echotrain.runtime.device import rng_devices

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert (rng_devices("cpu"), rng_devices(torch.device("cuda", 1)), rng_devices("cuda")) == ([], [1], [3])


def test_auto_is_the_trainer_default():
    from echotrain.train.config import TrainConfig

    assert TrainConfig().device == "auto"


def test_resume_reads_the_checkpoint_into_host_memory(tmp_path, monkeypatch):
    """The RNG states in a checkpoint must come back as CPU byte tensors (torch.set_rng_state and
    torch.cuda.set_rng_state_all refuse others), so resume_from maps the file to the CPU, not to
    the run's device; load_state_dict moves the rest."""
    import echotrain.train.checkpoint as ckpt
    from echotrain.train.dist import DistContext

    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()

    class Data:
        def state_dict(self):
            return {"pos": 5}

        def load_state_dict(self, state):
            self.state = state

    data = Data()
    (tmp_path / "checkpoints").mkdir()
    torch.save({"step": 2, "model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": None,
                "data": data.state_dict(), "rng": ckpt.rng_state(), "extra": {}},
               tmp_path / "checkpoints" / "step_00000002.pt")
    seen = []
    real = ckpt.load_checkpoint
    monkeypatch.setattr(ckpt, "load_checkpoint", lambda path, map_location="cpu": seen.append(map_location)
                        or real(path, map_location=map_location))
    step = ckpt.resume_from(tmp_path, model=model, optimizer=opt, scheduler=None, data=data, dist=DistContext())
    assert (step.step, seen, data.state) == (2, ["cpu"], {"pos": 5})
