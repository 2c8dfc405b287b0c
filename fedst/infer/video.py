"""The frames of an inference's input: a video file, a folder of frame images or a camera, read
with OpenCV as (time in seconds, RGB uint8) pairs (:func:`open_input`), with a text file or ANSI
art refused before FFmpeg draws its characters as frames."""

from __future__ import annotations

import codecs
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import cv2
import numpy as np

from fedst.infer.command import InferenceError

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".tif", ".tiff")
TEXT_SNIFF_BYTES = 4096
TEXT_CONTROLS = "\t\n\r\f\b\x1b"
"""Control characters a text file may hold (\\x1b: ANSI colour escapes); any other marks binary."""
TEXT_CODECS = ("ansi",)
"""Codecs of FFmpeg's text renderers: its "tty" demuxer opens a .txt / .nfo / .ans file and draws
its characters as 640x400 frames (codec "ansi")."""
TEXT_ART_SUFFIXES = (".bin", ".adf", ".idf", ".xb")
"""Extensions FFmpeg's "bintext" demuxer claims: it may draw such a file as ANSI art, with a codec
OpenCV has no four-character code for (refused only then: a video with one of these extensions
still has its codec's code)."""


@dataclass
class VideoInput:
    """Frames of a video file, frame folder or camera: ``frames()`` yields (time_s, RGB uint8)."""

    name: str
    fps: float
    num_frames: int | None
    _read: Callable[[], Iterator[tuple[float, np.ndarray]]]
    _close: Callable[[], None] | None = None

    def frames(self) -> Iterator[tuple[float, np.ndarray]]:
        yield from self._read()

    def close(self) -> None:
        if self._close is not None:
            self._close()


def open_input(spec: str, fps: float | None = None) -> VideoInput:
    """Open ``spec`` (video file, frame folder or camera index) or raise one clear InferenceError.

    A text file is refused before OpenCV opens it (:func:`_looks_like_text`), and a file FFmpeg
    opens as text or ANSI art after (TEXT_CODECS, TEXT_ART_SUFFIXES): FFmpeg would draw its
    characters as frames."""
    if fps is not None and fps <= 0:
        raise InferenceError(f"fps={fps} must be a positive number of frames per second")
    if spec.isdigit():
        return _open_camera(int(spec), fps)
    path = Path(spec)
    if not path.exists():
        raise InferenceError(f"input {path} does not exist (give a video file, folder or camera)")
    if path.is_dir():
        return _open_folder(path, fps)
    if path.stat().st_size == 0:
        raise InferenceError(f"input {path} is an empty file (0 bytes): nothing to read")
    if _looks_like_text(path):
        raise InferenceError(
            f"input {path} is a text file, not a video: cannot decode frames from it; give a "
            f"video file (.mp4, .avi, ...), a folder of frame images (with fps=) or a camera index"
        )
    capture = cv2.VideoCapture(str(path))
    ok, first = capture.read() if capture.isOpened() else (False, None)
    if not ok:
        capture.release()
        raise InferenceError(
            f"OpenCV cannot decode a frame of {path}: not a video or an unsupported codec; "
            f"re-encode it (ffmpeg -i {path.name} -c:v libx264 out.mp4) or pass a frame folder"
        )
    codec = _fourcc(capture)
    if codec.lower() in TEXT_CODECS or (not codec and path.suffix.lower() in TEXT_ART_SUFFIXES):
        capture.release()
        raise InferenceError(
            f"input {path} is a text or ANSI-art file, not a video (FFmpeg draws its characters "
            f"as frames, codec {codec or 'bintext'!r}); give a video file (.mp4, .avi, ...), a "
            f"folder of frame images (with fps=) or a camera index"
        )
    rate = fps or capture.get(cv2.CAP_PROP_FPS)
    if not rate or not np.isfinite(rate) or rate <= 0:
        capture.release()
        raise InferenceError(f"{path} reports no frame rate; pass fps=<frames per second>")
    count = int(capture.get(cv2.CAP_PROP_FRAME_COUNT))

    def read() -> Iterator[tuple[float, np.ndarray]]:
        frame, index = first, 0
        while frame is not None:
            yield index / rate, cv2.cvtColor(frame, cv2.COLOR_BGR2RGB)
            ok, frame = capture.read()
            frame, index = (frame if ok else None), index + 1

    return VideoInput(str(path), float(rate), count if count > 0 else None, read, capture.release)


def _looks_like_text(path: Path) -> bool:
    """Whether the file's first TEXT_SNIFF_BYTES bytes are UTF-8 text (printable characters,
    whitespace and ANSI escapes). No video container or image format starts like that: MP4, AVI,
    MPEG-TS, PNG and BMP have NUL bytes in their first header, Matroska / WebM and JPEG bytes
    that are not text."""
    with path.open("rb") as handle:
        head = handle.read(TEXT_SNIFF_BYTES)
    try:  # not final: a multi-byte character cut at the end of the sample is not an error
        text = codecs.getincrementaldecoder("utf-8")().decode(head, final=False)
    except UnicodeDecodeError:
        return False
    return not any((ord(c) < 0x20 and c not in TEXT_CONTROLS) or c == "\x7f" for c in text)


def _fourcc(capture: cv2.VideoCapture) -> str:
    """The codec's four-character code as OpenCV reports it ("" when it reports none)."""
    code = int(capture.get(cv2.CAP_PROP_FOURCC))
    return "".join(chr((code >> shift) & 0xFF) for shift in (0, 8, 16, 24)).strip("\x00")


def _open_folder(path: Path, fps: float | None) -> VideoInput:
    files = sorted(p for p in path.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
    if not files:
        raise InferenceError(f"folder {path} holds no frame images ({', '.join(IMAGE_SUFFIXES)})")
    if fps is None:
        raise InferenceError(
            f"{path} is a folder of frames, which has no frame rate: pass fps=<frames per second>"
        )

    def read() -> Iterator[tuple[float, np.ndarray]]:
        for index, file in enumerate(files):
            bgr = cv2.imread(str(file), cv2.IMREAD_COLOR)
            if bgr is None:
                raise InferenceError(f"cannot read image {file} (corrupt or not an image)")
            yield index / fps, cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB)

    return VideoInput(str(path), float(fps), len(files), read)


def _open_camera(index: int, fps: float | None) -> VideoInput:
    capture = cv2.VideoCapture(index)
    if not capture.isOpened():
        raise InferenceError(f"cannot open camera {index} with OpenCV (is it connected and free?)")
    rate = fps or capture.get(cv2.CAP_PROP_FPS)
    if not rate or rate <= 0:
        capture.release()
        raise InferenceError(f"camera {index} reports no frame rate; pass fps=<frames per second>")

    def read() -> Iterator[tuple[float, np.ndarray]]:
        start = None
        while True:
            ok, frame = capture.read()
            if not ok:
                return
            now = time.monotonic()
            start = now if start is None else start
            yield now - start, cv2.cvtColor(frame, cv2.COLOR_BGR2RGB)  # arrival time

    return VideoInput(f"camera{index}", float(rate), None, read, capture.release)
