// Times ONNX Runtime sessions for tests/bench/compare_onnxruntime.py (which writes the
// graphs and inputs and reads what this prints). Not a test; needs onnxruntime-node in
// a cache folder (the driver installs it there).
//
//   node ort_time.js JOB.json
//
// JOB.json: {"module": path of node_modules/onnxruntime-node, "threads": 2,
//   "min_time": seconds per graph, "graphs": [{"name", "path", "inputs": [{"name",
//   "type": "float32"|"int32", "dims", "file"}], "dump": file or null}]}
// Prints one JSON line per graph: {"name", "median_ms", "runs"}; with "dump", writes the
// first output's floats (little-endian f32) there after the timed runs.
'use strict';
const fs = require('fs');

function readTensor(ort, spec) {
  const buf = fs.readFileSync(spec.file);
  const bytes = new Uint8Array(buf.buffer, buf.byteOffset, buf.byteLength).slice();
  const data = spec.type === 'int32' ? new Int32Array(bytes.buffer) : new Float32Array(bytes.buffer);
  return new ort.Tensor(spec.type, data, spec.dims);
}

function median(xs) {
  const s = [...xs].sort((a, b) => a - b);
  const m = s.length >> 1;
  return s.length % 2 ? s[m] : (s[m - 1] + s[m]) / 2;
}

async function timeGraph(ort, job, graph) {
  const session = await ort.InferenceSession.create(graph.path, {
    intraOpNumThreads: job.threads,
    interOpNumThreads: 1,
    executionMode: 'sequential',
    graphOptimizationLevel: 'all',
  });
  const feeds = {};
  for (const spec of graph.inputs) feeds[spec.name] = readTensor(ort, spec);
  let result;
  for (let i = 0; i < 5; ++i) result = await session.run(feeds);  // warm-up
  const times = [];
  const deadline = process.hrtime.bigint() + BigInt(Math.round(job.min_time * 1e9));
  while (times.length < 10 || process.hrtime.bigint() < deadline) {
    const t0 = process.hrtime.bigint();
    result = await session.run(feeds);
    times.push(Number(process.hrtime.bigint() - t0) / 1e6);
  }
  if (graph.dump) {
    const out = result[session.outputNames[0]].data;
    fs.writeFileSync(graph.dump, Buffer.from(out.buffer, out.byteOffset, out.byteLength));
  }
  await session.release();
  return {name: graph.name, median_ms: median(times), runs: times.length};
}

async function main() {
  const job = JSON.parse(fs.readFileSync(process.argv[2], 'utf8'));
  const ort = require(job.module);
  for (const graph of job.graphs) {
    console.log(JSON.stringify(await timeGraph(ort, job, graph)));
  }
}

main().catch((e) => {
  console.error(e && e.stack ? e.stack : String(e));
  process.exit(1);
});
