"""Import-only stand-in (see ../README.md): OF3's experiment runner imports wandb at
module level; `bench train` runs with OF3's wandb logging off."""


def __getattr__(name):
    raise AttributeError(f"wandb stand-in: wandb.{name} needs the real wandb package")
