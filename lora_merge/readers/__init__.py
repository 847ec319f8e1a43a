"""Input readers: each turns an input on disk into named tensors, lazily, behind the `Source` interface
(readers/source.py); what a path is, is decided in readers/detect.py."""
