"""The stack's container images, and `pulumi up`'s refusal to deploy one pinned by tag only.

A tag, even a version tag, is a pointer whoever controls the repository can move to other code; a
digest names the content. `python -m infra lock-images` (infra/lock_images.py) resolves each image
of a stack file to its digest. The program calls `require_pinned_images` before it declares
anything: during `pulumi up` (the engine's run with dryRun false, which `pulumi.runtime.is_dry_run()`
reports) an image without a digest stops the program, unless the stack sets
`ray-eks:allowUnpinnedImages`; during `pulumi preview` it is a warning, so that a stack not yet
locked still previews (and the policy pack's `images-pinned-by-digest` says the same).
"""

from __future__ import annotations

import re

import pulumi

from infra.config import StackConfig, config_key

IMAGE_FIELDS = ("ray_image",)
"""The StackConfig fields that name a container image."""
_DIGEST_RE = re.compile(r"@sha256:[0-9a-f]{64}$")


def is_pinned_by_digest(image: str) -> bool:
    return bool(_DIGEST_RE.search(image))


def stack_images(cfg: StackConfig) -> dict[str, str]:
    """Stack-file key -> the image the stack deploys under it (its default when the file leaves it out)."""
    return {config_key(name): getattr(cfg, name) for name in IMAGE_FIELDS}


def unpinned_images(cfg: StackConfig) -> dict[str, str]:
    """The stack's images that name no digest, by key."""
    return {key: image for key, image in stack_images(cfg).items() if not is_pinned_by_digest(image)}


def require_pinned_images(cfg: StackConfig) -> None:
    """During `pulumi up`: pulumi.RunError (one line, no traceback) for an image without a digest, unless
    the stack allows them; then, and during `pulumi preview`, a warning."""
    unpinned = unpinned_images(cfg)
    if not unpinned:
        return
    stack, allow = pulumi.get_stack(), config_key("allow_unpinned_images")
    shown = ", ".join(f"{key} = {image!r}" for key, image in unpinned.items())
    if cfg.allow_unpinned_images:
        pulumi.log.warn(f"{allow} is true: the stack deploys {', '.join(unpinned)} pinned by tag only, which its "
                        f"registry can move to other code (python -m infra lock-images --stack {stack} pins it)")
    elif not pulumi.runtime.is_dry_run():
        raise pulumi.RunError(f"stack {stack}: {shown} is pinned by tag only, which its registry can move to "
                              f"other code: pulumi up deploys images pinned by digest. Fix: python -m infra "
                              f"lock-images --stack {stack} (writes repo:tag@sha256:... into Pulumi.{stack}.yaml), "
                              f"or, to deploy it anyway, pulumi config set {allow} true")
    else:
        pulumi.log.warn(f"pulumi up will refuse {shown}: it is pinned by tag only, which its registry can move "
                        f"to other code. Run python -m infra lock-images --stack {stack} to pin it by digest, "
                        f"or pulumi config set {allow} true")
