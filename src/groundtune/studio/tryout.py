"""The Try tab: an uploaded image and one phrase or several (one a line), answered by a run's model
or the tiny one with greedy decoding (infer.predict, the one generation path): each phrase's
boxes in the image's own pixels, one box, several or none.

The model is loaded in the studio's process on the first question (torch's import and the load:
seconds) and kept for the next ones; asking another model replaces it. The upload is decoded as
the server decodes one (deploy/reading.py: plain formats, the pixel limit, EXIF orientation).
"""

from __future__ import annotations

from groundtune.runs import METADATA_FILE, RunFolder
from groundtune.studio.launch import run_folder
from groundtune.studio.safety import Refusal

MAX_PHRASES = 16


def _model_name(studio, given: str) -> str:
    given = (given or "").strip()
    if given == "tiny":
        return given
    run = run_folder(studio, given)
    if not RunFolder(run).has_model:
        raise Refusal(f"{studio.paths.shown(run)}: no model/ yet (a run writes it at its first eval, or when it stops)")
    return str(run)


def _model(studio, name: str):
    """The loaded model of ``name``, kept until another is asked for."""
    from groundtune import infer

    marker = RunFolder(name).model / METADATA_FILE
    # a run's newer best model (its metadata is written last) is loaded anew
    key = (name, marker.stat().st_mtime if name != "tiny" and marker.exists() else None)
    kept = studio.cache.get("model")
    if kept is None or kept[0] != key:
        studio.cache["model"] = None  # the old one's memory goes before the new one loads
        studio.cache["model"] = (key, infer.load(name))
    return studio.cache["model"][1]


def _image(text: str):
    from groundtune.deploy.limits import Limits
    from groundtune.deploy.reading import RequestError, decode_image, image_bytes

    if not text:
        raise Refusal("upload an image first")
    try:
        return decode_image(image_bytes(str(text), "image"), Limits())
    except RequestError as e:
        raise Refusal(f"the upload: {e.message}") from None


def ground(studio, args: dict) -> dict:
    """Each phrase's boxes in the uploaded image."""
    from groundtune import infer

    phrases = [p.strip() for p in str(args.get("phrases") or "").splitlines() if p.strip()]
    if not phrases:
        raise Refusal("type a phrase (one a line for several)")
    if len(phrases) > MAX_PHRASES:
        raise Refusal(f"{len(phrases)} phrases: at most {MAX_PHRASES} at a time")
    name = _model_name(studio, args.get("model", ""))
    image = _image(args.get("image"))
    with studio.lock:  # one model in memory, one question at a time
        gm = _model(studio, name)
        predictions = infer.predict(gm, [image] * len(phrases), phrases, names=["the upload"] * len(phrases))
    return {"model": args.get("model"), "width": image.width, "height": image.height,
            "results": [{"phrase": phrase, **p.to_json()} for phrase, p in zip(phrases, predictions)]}
