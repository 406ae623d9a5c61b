"""ImageLoader as a demanding user meets it on the host backend: odd files and folders, argument
mistakes, and the promises of the issue and the images guide (docs/guides/images.rst) that the
other image test modules do not hold it to."""
from __future__ import annotations

import io
import os
import threading

import numpy as np
import pytest

from pinloader import ImageDecodeError, ImageLoader

from image_helpers import jpeg, photo

Image = pytest.importorskip("PIL.Image")


def labels(loader):
    return [np.from_dlpack(b["label"]).tolist() for b in loader]


@pytest.mark.hostile
def test_a_fifo_among_the_files_is_not_a_regular_file_and_never_blocks(tmp_path):
    # the host decoder and pack read each file alone: a FIFO without a writer under an image's
    # name must not block them (as the native reader of the GPU path does not)
    good = tmp_path / "a.jpg"
    good.write_bytes(jpeg(photo(20, 20, 0)))
    fifo = str(tmp_path / "f.jpg")
    os.mkfifo(fifo)
    done = threading.Event()

    def unblock():  # a reader blocked in open() is let go after a while: the test fails, not hangs
        if not done.wait(3):
            os.close(os.open(fifo, os.O_RDWR | os.O_NONBLOCK))
    t = threading.Thread(target=unblock, daemon=True)
    t.start()
    try:
        with ImageLoader([(str(good), 0), (fifo, 1)], 2, size=8, device="cpu", shuffle=False,
                         on_error="skip") as loader:
            assert labels(loader) == [[0]]
            (rec,) = loader.stats()["skipped_samples"]
        assert rec["index"] == 1 and rec["reason"] == "cannot be read (not a regular file)"
        with ImageLoader([(str(good), 0), (fifo, 1)], 2, size=8, device="cpu", shuffle=False) as loader:
            with pytest.raises(ImageDecodeError, match=r"sample 1 \(.*f\.jpg\): cannot be read \(not a regular file\)"):
                labels(loader)
            with pytest.raises(OSError, match="not a regular file"):
                loader.source.read_one(1)
    finally:
        done.set()
        t.join()


@pytest.mark.hostile
def test_pack_names_a_fifo_it_cannot_read(tmp_path):
    from pinloader._image_pack import pack
    (tmp_path / "src" / "cls").mkdir(parents=True)
    (tmp_path / "src" / "cls" / "a.jpg").write_bytes(jpeg(photo(20, 20, 0)))
    os.mkfifo(str(tmp_path / "src" / "cls" / "b.jpg"))
    with pytest.raises(OSError, match=r"b\.jpg: not a regular file"):
        pack(str(tmp_path / "src"), str(tmp_path / "dest"), quiet=True)


def _dds_of_an_unknown_pixel_format() -> bytes:
    # a DDS file whose pixel format flags were damaged: Pillow's DDS reader raises
    # NotImplementedError, not the OSError or ValueError of other damaged files
    buf = io.BytesIO()
    Image.fromarray(photo(24, 30, 0)).save(buf, format="DDS")
    data = bytearray(buf.getvalue())
    data[80] = 5
    return bytes(data)


@pytest.mark.hostile
def test_any_exception_of_pillows_readers_is_a_named_bad_sample(tmp_path):
    from pinloader import _image_ops as ops
    bad = _dds_of_an_unknown_pixel_format()
    for read in (ops.image_info, ops.decode_rgb):
        with pytest.raises(ValueError, match="NotImplementedError"):
            read(bad)
    good = tmp_path / "a.jpg"
    good.write_bytes(jpeg(photo(20, 20, 0)))
    odd = tmp_path / "b.jpg"
    odd.write_bytes(bad)
    items = [(str(good), 0), (str(odd), 1)]
    with ImageLoader(items, 2, size=8, device="cpu", shuffle=False) as loader:
        with pytest.raises(ImageDecodeError, match=r"sample 1 \(.*b\.jpg\): .*NotImplementedError"):
            labels(loader)
    with ImageLoader(items, 2, size=8, device="cpu", shuffle=False, on_error="skip") as loader:
        assert labels(loader) == [[0]]
        assert loader.stats()["skipped"] == 1


@pytest.mark.parametrize("dtype", [np.dtype("uint8"), np.dtype("float16"), np.float32])
def test_a_numpy_dtype_is_refused_not_made_float32(dtype):
    # np.dtype("uint8") == "uint8" is True: it passed the check and then gave float32 batches
    with pytest.raises(TypeError, match=r"ImageLoader: dtype must be one of the str .*'uint8'"):
        ImageLoader([("a.jpg", 0)], 1, device="cpu", dtype=dtype)


@pytest.mark.parametrize("kw, match", [
    ({"keys": "il"}, r"keys must be two different str"),
    ({"mean": "123", "std": "111"}, r"mean and std must be three numbers each"),
    ({"scale": "01"}, r"scale must be two numbers"),
    ({"ratio": "12"}, r"ratio must be two numbers"),
])
def test_a_str_is_not_taken_for_a_sequence_of_its_characters(kw, match):
    # keys="il" gave batches keyed "i" and "l"; ratio="12" was (1.0, 2.0)
    with pytest.raises(TypeError, match=match):
        ImageLoader([("a.jpg", 0)], 1, device="cpu", **kw)


@pytest.mark.parametrize("kw, err, match", [
    ({"batch_size": True}, TypeError, r"^ImageLoader: batch_size must be an int, not bool$"),
    ({"batch_size": 0}, ValueError, r"^ImageLoader: batch_size must be >= 1, got 0$"),
    ({"size": (True, 4)}, TypeError, r"^ImageLoader: size must be an int, not bool$"),
    ({"size": -3}, ValueError, r"^ImageLoader: size must be >= 1, got -3$"),
    ({"resize": 1.5, "train": False}, TypeError, r"^ImageLoader: resize must be an int, not float$"),
    ({"workers": 0}, ValueError, r"^ImageLoader: workers must be >= 1, got 0$"),
    ({"depth": True}, TypeError, r"^ImageLoader: depth must be an int, not bool$"),
    ({"world_size": 0}, ValueError, r"^ImageLoader: world_size must be >= 1, got 0$"),
    ({"rank": -1, "world_size": 2}, ValueError, r"^ImageLoader: rank must be >= 0, got -1$"),
])
def test_argument_errors_name_the_image_loader_and_the_argument(kw, err, match):
    # they said "ArrayLoader: ..." (the shared check's name)
    kw = {"batch_size": 1, **kw}
    with pytest.raises(err, match=match):
        ImageLoader([("a.jpg", 0)], kw.pop("batch_size"), device="cpu", **kw)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from image_helpers import make_folder
    return make_folder(str(tmp_path_factory.mktemp("review") / "folder"), n_per_class=4)


def images(loader):
    return np.concatenate([np.from_dlpack(b["image"]) for b in loader])


def test_flip_true_flips_evaluation_crops_too(folder):
    # flip=True with train=False was ignored without a word
    kw = dict(train=False, size=8, device="cpu", dtype="uint8")
    with ImageLoader(folder, 4, flip=True, **kw) as flipped, ImageLoader(folder, 4, **kw) as plain:
        f = flipped.params(0, range(12))[:, 8]
        assert 0 < f.sum() < 12
        assert (plain.params(0, range(12))[:, 8] == 0).all()
        a, b = images(flipped), images(plain)
        np.testing.assert_array_equal(a[f == 1], b[f == 1][..., ::-1])
        np.testing.assert_array_equal(a[f == 0], b[f == 0])
        # the same flips in another epoch's draws differ, as the training crops' do
        assert (flipped.params(1, range(12))[:, 8] != f).any()


def test_an_image_folder_may_hold_a_meta_json_of_its_own(folder, tmp_path):
    # a meta.json that is not a packed dataset's, beside class folders: an ImageFolder tree, as
    # torchvision reads it (it was refused as "not a pinloader.packed file")
    import shutil
    root = tmp_path / "withmeta"
    shutil.copytree(folder, root)
    for text in ('{"name": "my photos"}', "not json"):
        (root / "meta.json").write_text(text)
        with ImageLoader(str(root), 4, size=8, device="cpu") as loader, \
                ImageLoader(folder, 4, size=8, device="cpu") as plain:
            assert loader.source.kind == "files" and loader.classes == plain.classes
            assert labels(loader) == labels(plain)
    # without class folders, it is still a packed dataset's meta.json, named as such
    (tmp_path / "nopack").mkdir()
    (tmp_path / "nopack" / "meta.json").write_text('{"name": "x"}')
    with pytest.raises(ValueError, match="meta.json is not a pinloader.packed file"):
        ImageLoader(str(tmp_path / "nopack"), 4, device="cpu")


def test_an_unfinished_pack_is_named_as_one(folder, tmp_path, monkeypatch):
    # it was "has no class folders (ImageFolder layout ...)"
    from pinloader import _image_pack

    def dies(src, i):
        raise KeyboardInterrupt
    monkeypatch.setattr(_image_pack, "_read", dies)
    dest = str(tmp_path / "packed")
    with pytest.raises(KeyboardInterrupt):
        _image_pack.pack(folder, dest, quiet=True, workers=1)
    with pytest.raises(ValueError, match=r"packed is an unfinished pack \(progress.txt, no meta.json\): run "
                                         r"`python -m pinloader pack` again to finish it"):
        ImageLoader(dest, 4, device="cpu")


def _shard(path, members):
    import tarfile
    with tarfile.open(path, "w") as t:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
    return str(path)


def test_a_labelled_shard_sample_without_an_image_member_is_refused_not_dropped(tmp_path):
    # k3.gif with k3.cls: the sample was left out of the dataset without a word
    gif = io.BytesIO()
    Image.fromarray(photo(20, 20, 2)).save(gif, format="GIF")
    ok = [("dir/k1.jpg", jpeg(photo(20, 20, 1))), ("dir/k1.cls", b"3"), ("dir/k1.json", b"{}"),
          ("meta.json", b"{}")]  # extra members and keys without a label are not samples
    with ImageLoader(_shard(tmp_path / "ok.tar", ok), 4, size=8, device="cpu") as loader:
        assert labels(loader) == [[3]]
    bad = ok + [("k3.gif", gif.getvalue()), ("k3.cls", b"5")]
    with pytest.raises(ValueError, match=r"bad\.tar: k3\.cls labels no image \(its members: k3\.cls, k3\.gif; "
                                         r"images are \.jpg, \.jpeg, \.png"):
        ImageLoader(_shard(tmp_path / "bad.tar", bad), 4, device="cpu")


def test_pack_refuses_a_destination_inside_the_image_folder(folder, tmp_path):
    # DEST inside SRC made a class folder of it: every later ImageFolder read of SRC (ours and
    # torchvision's) had one class more, and labels shifted when its name sorts first
    import shutil

    from pinloader._image_pack import pack
    src = tmp_path / "src"
    shutil.copytree(folder, src)
    before = sorted(os.listdir(src))
    for dest in (src / "_packed", src, src / "a_cat" / "p"):
        with pytest.raises(ValueError, match=r"pack: .* is inside the image folder .*src"):
            pack(str(src), str(dest), quiet=True)
        assert sorted(os.listdir(src)) == before
        assert not os.path.exists(src / "a_cat" / "p")
    assert pack(str(src), str(tmp_path / "src_packed"), quiet=True) == 12  # beside it, a shared prefix


def test_pack_refuses_a_worker_count_below_one(folder, tmp_path, capsys):
    # --workers -1 said "max_workers must be greater than 0"; --workers 0 took the default
    from pinloader.__main__ import main
    from pinloader._image_pack import pack
    for bad in (0, -1, True):
        with pytest.raises((ValueError, TypeError), match=r"^pack: workers must be an int >= 1, got"):
            pack(folder, str(tmp_path / "p"), workers=bad, quiet=True)
    for bad in ("0", "-1", "x"):
        with pytest.raises(SystemExit) as e:
            main(["pack", folder, str(tmp_path / "q"), "--workers", bad])
        assert e.value.code == 2
        assert "argument --workers: must be an integer >= 1" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "p") and not os.path.exists(tmp_path / "q")


def test_an_evaluation_resize_smaller_than_the_crop_is_refused(folder):
    # torchvision's CenterCrop pads such an image with zeros; the loader stretched it to the
    # crop's size instead, without a word
    with pytest.raises(ValueError, match=r"ImageLoader: resize \(200\) must be at least the larger "
                                         r"side of size \(224, 224\) when train=False"):
        ImageLoader(folder, 4, train=False, size=224, resize=200, device="cpu")
    with pytest.raises(ValueError, match=r"resize \(300\) .* size \(100, 320\)"):
        ImageLoader(folder, 4, train=False, size=(100, 320), resize=300, device="cpu")
    # where the crop fits (or resize is not used) it is taken
    ImageLoader(folder, 4, train=False, size=224, resize=224, device="cpu").close()
    ImageLoader(folder, 4, train=True, size=224, resize=200, device="cpu").close()


def test_a_large_size_without_resize_is_not_refused_for_the_default_resize():
    # size=15000 made the default resize 17143, refused as "resize must be at most 16384"
    # although no resize was given (and a training crop does not use it)
    for train in (True, False):
        ImageLoader([("a.jpg", 0)], 1, size=15000, train=train, device="cpu").close()


@pytest.mark.hostile
def test_an_evaluation_resize_past_int32_is_not_wrapped():
    # a 1 x 9,000,000 PNG (26 KB) resized to a short side of 256 is 2.3 billion pixels wide: the
    # parameters wrapped around int32 (a negative width) and Pillow said "height and width must
    # be > 0"
    from pinloader import _image_ops as ops
    p = ops.eval_params(np.array([[1, 9_000_000]]), (224, 224), 256)[0]
    assert p[4] == 256 and p[5] == 2**31 - 1 and p[7] >= 0
    buf = io.BytesIO()
    Image.new("RGB", (9_000_000, 1)).save(buf, format="PNG")
    with pytest.raises(ValueError, match=r"resizing the 1 x 9000000 image to 256 x 2147483647 or more is past "
                                         r"Pillow's image size limit"):
        ops.host_decode(buf.getvalue(), p, (224, 224), (1, 9_000_000))


def test_an_empty_class_folder_is_refused_as_torchvision_refuses_it(folder, tmp_path):
    # it was taken as a class with no images: a label no sample has, and a shift of every label
    # after it (".ipynb_checkpoints" sorts first) that torchvision's ImageFolder would have refused
    import shutil
    root = tmp_path / "tree"
    shutil.copytree(folder, root)
    (root / ".ipynb_checkpoints").mkdir()
    (root / "d_notes").mkdir()
    (root / "d_notes" / "readme.txt").write_text("x")
    with pytest.raises(ValueError, match=r"no image files in the class folders \.ipynb_checkpoints, d_notes of .*tree "
                                         r"\(torchvision's ImageFolder refuses them too"):
        ImageLoader(str(root), 4, device="cpu")


def test_params_names_the_sample_it_cannot_size(tmp_path):
    # params() raised the file's own FileNotFoundError, or "not an image Pillow recognizes"
    # without the sample, and an IndexError for an index past the end
    good = tmp_path / "a.jpg"
    good.write_bytes(jpeg(photo(20, 20, 0)))
    (tmp_path / "b.jpg").write_bytes(b"not an image")
    items = [(str(good), 0), (str(tmp_path / "b.jpg"), 1), (str(tmp_path / "gone.jpg"), 2)]
    with ImageLoader(items, 2, size=8, device="cpu") as loader:
        assert loader.params(0, [0]).shape == (1, 9)
        with pytest.raises(ImageDecodeError, match=r"sample 1 \(.*b\.jpg\): not an image"):
            loader.params(0, [0, 1])
        with pytest.raises(ImageDecodeError, match=r"sample 2 \(.*gone\.jpg\): cannot be read \(\[Errno 2\]"):
            loader.params(0, [2])
        for bad in (3, -1):
            with pytest.raises(IndexError, match=rf"ImageLoader.params: sample {bad} is not in 0\.\.2"):
                loader.params(0, [bad])


def test_pack_refuses_a_destination_holding_other_files(folder, tmp_path):
    # it wrote data.bin, labels.npy, ... among them, replacing any of the same name
    from pinloader._image_pack import pack
    dest = tmp_path / "mine"
    dest.mkdir()
    np.save(dest / "labels.npy", np.arange(3))
    (dest / "notes.txt").write_text("keep me")
    with pytest.raises(ValueError, match=r"pack: .*mine holds other files than a stopped pack's "
                                         r"\(labels\.npy, notes\.txt\): choose an empty or new folder"):
        pack(folder, str(dest), quiet=True)
    assert sorted(os.listdir(dest)) == ["labels.npy", "notes.txt"]
    assert np.load(dest / "labels.npy").tolist() == [0, 1, 2]
    # an empty folder is taken
    (tmp_path / "empty").mkdir()
    assert pack(folder, str(tmp_path / "empty"), quiet=True) == 12


# ---- promises held (no defect found; kept so that they stay held) ----

def test_exif_orientation_is_ignored_as_the_guide_says(tmp_path):
    # a 20 x 40 image stored with EXIF orientation 6 ("rotate 90 on display"): the pixels are
    # used as stored, 20 x 40, as torchvision.io.decode_jpeg and ImageFolder's PIL loader do
    from image_helpers import reference
    exif = Image.Exif()
    exif[0x0112] = 6
    p = tmp_path / "rot.jpg"
    blob = jpeg(photo(20, 40, 3), exif=exif.tobytes())
    p.write_bytes(blob)
    assert Image.open(io.BytesIO(blob)).getexif()[0x0112] == 6
    with ImageLoader([(str(p), 0)], 1, train=False, size=(8, 16), resize=16, device="cpu",
                     dtype="uint8") as loader:
        params = loader.params(0, [0])
        assert params[0, 2:4].tolist() == [20, 40]  # the box is the stored image
        (got,) = images(loader)
    np.testing.assert_array_equal(got, reference(blob, params[0], (8, 16), dtype="uint8"))


def test_ctrl_c_while_a_batch_decodes_stays_a_keyboard_interrupt_and_loses_nothing(folder, monkeypatch):
    import signal

    from pinloader import _image_ops as ops
    kw = dict(size=8, device="cpu", seed=4, depth=1, workers=2)
    with ImageLoader(folder, 3, **kw) as plain:
        want, want1 = labels(plain), labels(plain)
    real = ops.host_decode
    asked, sent = threading.Event(), []

    def decode(*a, **k):  # every decode waits until the test asks; the first then sends Ctrl-C
        asked.wait(30)
        if not sent:
            sent.append(True)
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
        return real(*a, **k)
    monkeypatch.setattr(ops, "host_decode", decode)
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with ImageLoader(folder, 3, **kw) as loader:
            it = iter(loader)
            with pytest.raises(KeyboardInterrupt):
                asked.set()
                next(it)
            got = [np.from_dlpack(b["label"]).tolist() for b in it]  # the batch interrupted included
            assert got == want and sent
            monkeypatch.setattr(ops, "host_decode", real)
            assert labels(loader) == want1  # and the loader goes on
    finally:
        signal.signal(signal.SIGINT, old)


def test_memory_is_flat_over_epochs(folder):
    import gc
    import tracemalloc
    with ImageLoader(folder, 5, size=8, device="cpu") as loader:
        for _ in range(3):
            labels(loader)
        gc.collect()
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            for _ in range(20):
                labels(loader)
                loader.state_dict()
            gc.collect()
            grown = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
    # 20 epochs of 12 images: Python's and Pillow's caches settle within tens of KB; a batch
    # (5 x 3 x 8 x 8 float32, 3.8 KB) kept per epoch would fail it
    assert grown < 64 * 1024


@pytest.mark.parametrize("kw, match", [({"scale": (0.5, 0.1)}, "scale must be"), ({"ratio": (2, 1)}, "ratio must be")])
def test_bad_arguments_are_refused_before_the_source_is_read(tmp_path, kw, match):
    # scale= and ratio= were checked after the ImageFolder tree was walked (minutes for a large one)
    with pytest.raises(ValueError, match=match):
        ImageLoader(str(tmp_path / "nowhere"), 4, device="cpu", **kw)


@pytest.mark.parametrize("kw, match", [
    ({"shufle": True}, r"^ImageLoader\(\) got an unexpected keyword argument 'shufle' \(did you mean 'shuffle'\?\)$"),
    ({"stattic": True}, r"'stattic' \(did you mean 'static'\?\)$"),
    ({"structure": 1}, r"unexpected keyword argument 'structure'$"),
])
def test_an_unknown_keyword_is_refused_where_the_loader_is_made(kw, match):
    # it went to the prefetcher and failed at the first iteration ("'shufle' is an invalid
    # keyword argument for AsyncPrefetcher()"), or was taken (structure=), as ArrayLoader refuses it
    with pytest.raises(TypeError, match=match):
        ImageLoader([("a.jpg", 0)], 1, device="cpu", **kw)


def test_pack_of_two_folders_is_a_message_not_a_traceback(folder, tmp_path, capsys):
    from pinloader.__main__ import main
    assert main(["pack", folder, folder, str(tmp_path / "p")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("pinloader pack: ") and "must be .tar shards" in err and "Traceback" not in err


@pytest.mark.parametrize("version", [2, 99, "1", None])
def test_a_packed_dataset_of_another_format_version_is_refused(folder, tmp_path, version):
    # meta.json's version was never read: a later format would be read as this one
    import json
    import shutil

    from pinloader._image_pack import pack
    dest = tmp_path / "p"
    pack(folder, str(dest), quiet=True)
    meta = json.loads((dest / "meta.json").read_text())
    meta["version"] = version
    (dest / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=rf"meta.json: format version {version!r}, this pinloader reads version 1"):
        ImageLoader(str(dest), 4, device="cpu")
    shutil.rmtree(dest)


def test_a_size_that_does_not_match_the_image_says_where_it_came_from(folder, tmp_path):
    # "decoded to 43 x 68, its header said 5 x 5": the 5 x 5 was sizes.npy's (or the size read
    # when the file was first met, before it was replaced), not the header's
    from pinloader._image_pack import pack
    dest = tmp_path / "p"
    pack(folder, str(dest), quiet=True)
    np.save(dest / "sizes.npy", np.full((12, 3), 5, np.int32))
    with ImageLoader(str(dest), 4, size=8, device="cpu", shuffle=False) as loader:
        with pytest.raises(ImageDecodeError, match=r"sample 0 .*: decoded to \d+ x \d+, not the 5 x 5 its "
                                                   r"crop was drawn for \(the packed sizes.npy's, or its "
                                                   r"header's when the file was first read\)"):
            labels(loader)
