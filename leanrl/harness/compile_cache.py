"""--compile-cache DIR: what a warm-up builds, kept in a folder that a fresh process, or another machine of the same
GPU and versions, starts warm from: torch.compile's artifacts (PyTorch's portable cache: Inductor, AOTAutograd,
Triton, autotuning) and MuJoCo Warp's kernels."""

import hashlib
import os
import sys

import torch


def kernel_caches_in(folder):
    """Warp's kernel cache in folder, and the CUDA driver's, which holds the machine code it compiles from the PTX
    Warp builds (Humanoid's kernels on an H200: 56 s with the driver's cache empty, 23 s with it full); a second
    machine would compile that again. Set before CUDA starts, which reads where its cache is."""
    os.environ["WARP_CACHE_PATH"] = os.path.join(os.path.abspath(folder), "warp")  # a folder per Warp version in it
    os.environ["CUDA_CACHE_PATH"] = os.path.join(os.path.abspath(folder), "cuda")


class CompileCache:
    def __init__(self, folder, device):
        """Loads this GPU's (model and index) and versions' torch artifacts from folder (Warp's and the driver's
        kernels: kernel_caches_in)."""
        os.makedirs(folder, exist_ok=True)
        gpu = "cpu"
        if device.type == "cuda":  # compiled code names its device: under torchrun each rank's index has its file
            index = torch.cuda.current_device()
            gpu = torch.cuda.get_device_name(index) + (f" as cuda:{index}" if index else "")
        self.made_with = f"torch {torch.__version__} (CUDA {torch.version.cuda}) on {gpu}"
        # A file per GPU and versions: another's artifacts are never loaded, and its file stays for its machines.
        self.file = os.path.join(folder, f"torch-{hashlib.sha256(self.made_with.encode()).hexdigest()[:16]}.bin")
        said = f"--compile-cache {folder}:"
        try:
            with open(self.file, "rb") as f:
                torch.compiler.load_cache_artifacts(f.read())
            print(f"{said} the compiled code of {self.made_with} loaded", file=sys.stderr)
            return
        except FileNotFoundError:
            pass
        except Exception as e:  # a truncated copy: compiled again, and written anew after the warm-up
            print(f"{said} {os.path.basename(self.file)} unreadable ({type(e).__name__}): compiling", file=sys.stderr)
            return
        others = [open(os.path.join(folder, n)).read() for n in sorted(os.listdir(folder)) if n.endswith(".txt")]
        print(f"{said} nothing for {self.made_with} yet" + (f" (it holds {'; '.join(others)})" if others else "")
              + ": compiling, saved there after the warm-up", file=sys.stderr)  # fmt: skip

    def save(self):
        """What this process compiled or loaded, beside other machines' artifacts; each file written atomically."""
        artifacts = torch.compiler.save_cache_artifacts()
        for path, data in ((self.file, artifacts and artifacts[0]), (self.file[:-4] + ".txt", self.made_with.encode())):
            if artifacts:
                with open(f"{path}.{os.getpid()}.tmp", "wb") as f:
                    f.write(data)
                os.replace(f"{path}.{os.getpid()}.tmp", path)
