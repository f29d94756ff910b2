#!/usr/bin/env python3
"""Reads a Perfetto trace written by `fragscope export --format perfetto`
with Perfetto's own generated classes (the `perfetto` package's
perfetto_trace_pb2) and prints what it holds as JSON: the tracks, each
counter track's (ts, value) series keyed by its top-level track's name
(`pid N`, `device N`) and its own, the instants with their debug
annotations, and the slices. fragscope's tests compare this with the
Trace Event JSON export of the same trace.

A field that Perfetto's schema does not know is an error, so a wrong field
number in fragscope's writer cannot pass unnoticed.

Usage: readback-perfetto.py TRACE.pftrace
"""
import json
import sys

from google.protobuf import unknown_fields
from perfetto.protos.perfetto.trace import perfetto_trace_pb2 as pb


def no_unknown(msg, where):
    if len(unknown_fields.UnknownFieldSet(msg)):
        sys.exit(f"{where}: fields unknown to Perfetto's schema")
    for field, value in msg.ListFields():
        if field.type == field.TYPE_MESSAGE:
            items = value if field.is_repeated else [value]
            for i, v in enumerate(items):
                no_unknown(v, f"{where}.{field.name}[{i}]")


def annotation(a):
    kind = a.WhichOneof("value")
    return a.name, getattr(a, kind) if kind else None


def main(path):
    trace = pb.Trace()
    with open(path, "rb") as f:
        trace.ParseFromString(f.read())
    tracks, counters, instants, slices, open_slices = {}, {}, [], [], {}
    sequences = set()
    last_ts = 0
    for i, p in enumerate(trace.packet):
        no_unknown(p, f"packet[{i}]")
        sequences.add(p.trusted_packet_sequence_id)
        if p.HasField("track_descriptor"):
            d = p.track_descriptor
            parent = tracks.get(d.parent_uuid) if d.HasField("parent_uuid") else None
            pid = d.process.pid if d.HasField("process") else (parent["pid"] if parent else None)
            unit = pb.CounterDescriptor.Unit.Name(d.counter.unit) if d.HasField("counter") else None
            root = parent["root"] if parent else d.name
            tracks[d.uuid] = {"name": d.name, "pid": pid, "unit": unit, "counter": d.HasField("counter"),
                              "process": d.HasField("process"), "root": root}
            continue
        if not p.HasField("track_event"):
            continue
        if p.timestamp < last_ts:
            sys.exit(f"packet[{i}]: timestamp {p.timestamp} before {last_ts}")
        last_ts = p.timestamp
        e = p.track_event
        track = tracks[e.track_uuid]
        kind = pb.TrackEvent.Type.Name(e.type)
        if kind == "TYPE_COUNTER":
            assert track["counter"], track
            v = e.double_counter_value if e.HasField("double_counter_value") else e.counter_value
            counters.setdefault(f'{track["root"]}/{track["name"]}', []).append([p.timestamp, v])
        elif kind == "TYPE_INSTANT":
            args = dict(annotation(a) for a in e.debug_annotations)
            instants.append({"root": track["root"], "pid": track["pid"], "track": track["name"], "name": e.name,
                             "ts": p.timestamp, "args": args})
        elif kind == "TYPE_SLICE_BEGIN":
            assert e.track_uuid not in open_slices, f"packet[{i}]: a slice begins inside another"
            open_slices[e.track_uuid] = (e.name, p.timestamp)
        elif kind == "TYPE_SLICE_END":
            name, begin = open_slices.pop(e.track_uuid)
            slices.append({"root": track["root"], "pid": track["pid"], "track": track["name"], "name": name,
                           "begin": begin, "end": p.timestamp})
    assert not open_slices, open_slices
    json.dump({"packets": len(trace.packet), "sequences": sorted(sequences),
               "tracks": sorted(t["name"] for t in tracks.values()),
               "processes": sorted(t["pid"] for t in tracks.values() if t["process"]),
               "roots": sorted(t["name"] for t in tracks.values() if t["root"] == t["name"]),
               "units": {t["name"]: t["unit"] for t in tracks.values() if t["counter"]},
               "counters": counters, "instants": instants, "slices": slices}, sys.stdout)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
