"""Find where the GPU node group can really launch, and write it into the stack file.

`python -m capacity probe --help`; see docs/CAPACITY.md.
"""
