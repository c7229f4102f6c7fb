"""`python -m infra lock-images --stack NAME`: each image of a stack file pinned by the digest its tag
names now, written back as `repo:tag@sha256:...` with every other key and comment of the file kept.

An image the file leaves out (the stack then deploys its default) is added under its key; an image
pinned by digest already has its digest read again for its tag (a moved tag is followed, and said);
an image with a digest and no tag has nothing to resolve and is kept.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from infra.config import load_stack_config, parse_stack_config, read_stack_values, stack_file
from infra.config.stack_edit import StackUpdate, check_only_keys_changed, dump, faithful_load
from infra.images import stack_images
from infra.registry import ImageReference, RegistryError


class ImageLockError(Exception):
    """The registry could not say which digest an image's tag names."""

    def __init__(self, *, key: str, image: str, error: RegistryError):
        self.key, self.image, self.error = key, image, error
        super().__init__(f"{key} = {image!r}: {error}")


@dataclass(frozen=True, kw_only=True)
class LockedImage:
    """One image of the stack, before and after locking."""

    key: str
    """Its stack-file key (`ray-eks:rayImage`)."""
    before: str
    """The image the stack deploys now."""
    after: str
    """The same image pinned by the digest its tag names (`before` when it has no tag)."""

    @property
    def changed(self) -> bool:
        return self.before != self.after


def plan_lock(*, stack: str, project_dir: Path | str, resolve: Callable[[ImageReference], str]
              ) -> tuple[list[LockedImage], StackUpdate]:
    """Each image of `Pulumi.<stack>.yaml` and the file's new text, with `resolve` (a reference -> its
    tag's digest) asked once per image. ConfigError when the file is not a valid stack file (nothing
    asked then), StackFileError when it cannot be edited without touching other lines, ImageLockError
    (naming the key and the image) when `resolve` raises a RegistryError."""
    cfg = load_stack_config(stack, project_dir)
    path = stack_file(stack, project_dir)
    locked = []
    for key, image in stack_images(cfg).items():
        ref = ImageReference.parse(image)
        try:
            after = ref.pinned(resolve(ref)) if ref.tag else image
        except RegistryError as exc:
            raise ImageLockError(key=key, image=image, error=exc) from None
        locked.append(LockedImage(key=key, before=image, after=after))
    before, written = path.read_text(), read_stack_values(path)
    changes = {i.key: i.after for i in locked if i.changed or i.key not in written}
    if not changes:
        return locked, StackUpdate(path=path, before=before, after=before)
    yaml, doc = faithful_load(before, path, keys=changes)
    config = doc["config"]
    for key, image in changes.items():
        config[key] = image
    after = dump(yaml, doc)
    check_only_keys_changed(before, after, path, keys=changes,
                            fix="set " + ", ".join(f"{k}: {v}" for k, v in changes.items()) + " by hand")
    parse_stack_config(dict(config))  # what is written is still a valid stack config
    return locked, StackUpdate(path=path, before=before, after=after)
