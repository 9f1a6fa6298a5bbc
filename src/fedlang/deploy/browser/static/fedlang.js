// fedlang.js: a browser client of a fedlang task store (docs/deploy.md, "Browser clients").
//
// A page enrolls with a population's token, checks in, downloads the signed round plan
// and the broadcast value, verifies the plan's Ed25519 signature against the key it
// pinned at enrollment (WebCrypto), runs the plan's browser task (ONNX programs, with
// onnxruntime-web served by the same server) over data the page holds, pre-aggregates
// its contribution exactly as a Python client does and uploads the report. It only ever
// connects out, waits as long as the server says (pace steering) and retries with
// exponential backoff and jitter while the server is unreachable (e.g. restarting).
//
//   import {FedlangClient, batches} from "/browser/fedlang.js";
//   const client = new FedlangClient({population: "digits", token,
//       data: {train: batches({x: {data: xs, shape: [n, 64]}, y: {data: ys, shape: [n]}}, 20)},
//       onEvent: (e) => console.log(e)});
//   await client.run();

import * as ort from "./ort/ort.wasm.min.mjs";

const API = "/v1";
const TASK_FORMAT = "fedlang-browser-task";
const TASK_VERSION = 1;
const ARRAYS = {
  float32: Float32Array, float64: Float64Array, int32: Int32Array, int64: BigInt64Array,
  int8: Int8Array, uint8: Uint8Array, bool: Uint8Array,
};

export class FedlangError extends Error {
  constructor(message, status = 0, reason = "") {
    super(message);
    this.name = "FedlangError";
    this.status = status;
    this.reason = reason;
  }
}

// ---------------------------------------------------------------------------
// Bytes: base64, SHA-256, CRC-32, the signed envelope and the binary value format

export function fromBase64(text) {
  const raw = atob(text);
  const out = new Uint8Array(raw.length);
  for (let i = 0; i < raw.length; i++) out[i] = raw.charCodeAt(i);
  return out;
}

export function toBase64(bytes) {
  let raw = "";
  for (let i = 0; i < bytes.length; i += 0x8000) {
    raw += String.fromCharCode.apply(null, bytes.subarray(i, i + 0x8000));
  }
  return btoa(raw);
}

async function sha256(bytes) {
  return new Uint8Array(await crypto.subtle.digest("SHA-256", bytes));
}

function hex(bytes) {
  return Array.from(bytes, (b) => b.toString(16).padStart(2, "0")).join("");
}

const CRC_TABLE = (() => {
  const table = new Uint32Array(256);
  for (let n = 0; n < 256; n++) {
    let c = n;
    for (let k = 0; k < 8; k++) c = c & 1 ? 0xedb88320 ^ (c >>> 1) : c >>> 1;
    table[n] = c >>> 0;
  }
  return table;
})();

export function crc32(bytes) {
  let c = 0xffffffff;
  for (let i = 0; i < bytes.length; i++) c = CRC_TABLE[(c ^ bytes[i]) & 0xff] ^ (c >>> 8);
  return (c ^ 0xffffffff) >>> 0;
}

// The header that binds an upload to the task it was computed for (protocol.task_header):
// canonical JSON of the task's round, session and version; the server refuses an upload
// computed for another task (409 stale) and one without it (400 unbound).
export const TASK_HEADER = "Fedlang-Task";

export function taskHeader(task) {
  const named = { round: task.round ?? null, session: task.session ?? null,
                  version: task.version ?? null };
  return { [TASK_HEADER]: JSON.stringify(named) };
}

// The payload of a signed envelope (FEDS, u16 version 1, 8-byte key id, 64-byte Ed25519
// signature over the 14 bytes before it and the payload), once it verifies.
export async function verifySigned(bytes, publicKey) {
  if (!(crypto && crypto.subtle)) {
    throw new FedlangError("Expected WebCrypto (a secure context: https:// or 127.0.0.1), " +
                           "found none; serve the page over TLS.");
  }
  const magic = new TextDecoder().decode(bytes.subarray(0, 4));
  if (bytes.length < 78 || magic !== "FEDS") {
    throw new FedlangError("Expected a plan signed by the server (FEDS envelope), found " +
                           "unsigned or truncated bytes.");
  }
  const view = new DataView(bytes.buffer, bytes.byteOffset, bytes.byteLength);
  if (view.getUint16(4, true) !== 1) {
    throw new FedlangError(`Expected signed envelope version 1, found ${view.getUint16(4, true)}.`);
  }
  const keyId = bytes.subarray(6, 14);
  const pinnedId = (await sha256(publicKey)).subarray(0, 8);
  if (hex(keyId) !== hex(pinnedId)) {
    throw new FedlangError(`The plan was signed by key ${hex(keyId)}, not by the pinned key ` +
                           `${hex(pinnedId)}; refusing it.`);
  }
  const payload = bytes.subarray(78);
  const signed = new Uint8Array(14 + payload.length);
  signed.set(bytes.subarray(0, 14));
  signed.set(payload, 14);
  let key;
  try {
    key = await crypto.subtle.importKey("raw", publicKey, { name: "Ed25519" }, false, ["verify"]);
  } catch (e) {
    throw new FedlangError(`Expected a browser with Ed25519 in WebCrypto, found: ${e}.`);
  }
  const ok = await crypto.subtle.verify({ name: "Ed25519" }, key, bytes.subarray(14, 78), signed);
  if (!ok) {
    throw new FedlangError("The plan's signature does not verify against the pinned key: the " +
                           "bytes were changed after signing.");
  }
  return payload;
}

// A tensor as the page and the programs hold it: {dtype, shape, data (a typed array)}.
function tensor(dtype, shape, data) {
  return { dtype, shape: shape.map(Number), data };
}

function size(shape) {
  return shape.reduce((a, b) => a * b, 1);
}

// The tensors of a value in the binary value format, in the format's order.
export function readValue(bytes) {
  const view = new DataView(bytes.buffer, bytes.byteOffset, bytes.byteLength);
  const magic = new TextDecoder().decode(bytes.subarray(0, 4));
  if (bytes.length < 15 || magic !== "FEDL" || view.getUint16(4, true) !== 1 ||
      view.getUint8(6) !== 2) {
    throw new FedlangError("Expected a fedlang value (FEDL, version 1, kind 2), found other bytes.");
  }
  if (crc32(bytes.subarray(0, bytes.length - 4)) !== view.getUint32(bytes.length - 4, true)) {
    throw new FedlangError("Expected the value's CRC-32 to match, found another (corrupted).");
  }
  const headLen = view.getUint32(7, true);
  const header = JSON.parse(new TextDecoder().decode(bytes.subarray(11, 11 + headLen)));
  let pos = 11 + headLen;
  const blobs = [];
  for (let i = 0; i < header.blobs; i++) {
    const n = Number(view.getBigUint64(pos, true));
    blobs.push(bytes.slice(pos + 8, pos + 8 + n));  // a copy: typed arrays need alignment
    pos += 8 + n;
  }
  const out = [];
  const walk = (v) => {
    if (Array.isArray(v)) {
      v.forEach(walk);
    } else if (v && typeof v === "object" && "blob" in v) {
      const Array_ = ARRAYS[v.dtype];
      if (!Array_) throw new FedlangError(`Expected a tensor of ${Object.keys(ARRAYS)}, found ${v.dtype}.`);
      out.push(tensor(v.dtype, v.shape, new Array_(blobs[v.blob].buffer)));
    } else {
      throw new FedlangError("Expected tensors and structs in the value, found another kind.");
    }
  };
  walk(header.value);
  return out;
}

// A value in the binary value format as nested objects, its struct fields by name: a
// struct whose fields all have names is an object, another struct an array, a tensor
// {dtype, shape, data} (what `readValue` returns, in place).
export function readStructured(bytes) {
  const leaves = readValue(bytes);  // checks the format and the CRC
  const view = new DataView(bytes.buffer, bytes.byteOffset, bytes.byteLength);
  const headLen = view.getUint32(7, true);
  const header = JSON.parse(new TextDecoder().decode(bytes.subarray(11, 11 + headLen)));
  let next = 0;
  const take = (v) => {  // the leaves of `v`, in readValue's order
    if (Array.isArray(v)) return v.flatMap(take);
    return [leaves[next++]];
  };
  const build = (t, v) => {
    if (t.t !== "struct") {
      const taken = take(v);
      return t.t === "tensor" ? taken[0] : taken;
    }
    const fields = t.fields.map(([name, ft], i) => [name, build(ft, v[i])]);
    return fields.length && fields.every(([name]) => name !== null)
      ? Object.fromEntries(fields) : fields.map(([, x]) => x);
  };
  return build(header.types[header.type], header.value);
}

// A value in the binary value format from a header template and its tensors.
export function writeValue(template, leaves) {
  const header = JSON.parse(JSON.stringify(template));
  let i = 0;
  const fill = (v) => {
    if (Array.isArray(v)) {
      v.forEach(fill);
    } else if (v && typeof v === "object" && "blob" in v) {
      v.shape = leaves[i++].shape;
    }
  };
  fill(header.value);
  const head = new TextEncoder().encode(JSON.stringify(header));
  const parts = [head];
  let total = 11 + head.length;
  for (const leaf of leaves) {
    const raw = new Uint8Array(leaf.data.buffer, leaf.data.byteOffset, leaf.data.byteLength);
    parts.push(raw);
    total += 8 + raw.length;
  }
  const out = new Uint8Array(total + 4);
  const view = new DataView(out.buffer);
  out.set(new TextEncoder().encode("FEDL"), 0);
  view.setUint16(4, 1, true);
  view.setUint8(6, 2);
  view.setUint32(7, head.length, true);
  out.set(head, 11);
  let pos = 11 + head.length;
  for (const raw of parts.slice(1)) {
    view.setBigUint64(pos, BigInt(raw.length), true);
    out.set(raw, pos + 8);
    pos += 8 + raw.length;
  }
  view.setUint32(pos, crc32(out.subarray(0, pos)), true);
  return out;
}

// `values` (a typed array or a plain array) as a typed array of `dtype`.
function convert(values, dtype) {
  const Array_ = ARRAYS[dtype];
  if (values instanceof Array_) return values;
  if (dtype === "int64") return BigInt64Array.from(values, (x) => BigInt(Math.trunc(Number(x))));
  if (dtype === "bool") return Uint8Array.from(values, (x) => (x ? 1 : 0));
  return Array_.from(values, Number);
}

// ---------------------------------------------------------------------------
// Data: batches of the page's tensors

// Cuts tensors `{name: {data, shape}}` (the same number of rows each) into batches of
// `batchSize` rows: an array of `{name: {data, shape}}`.
export function batches(fields, batchSize = 20) {
  const names = Object.keys(fields);
  const rows = new Set(names.map((n) => fields[n].shape[0]));
  if (rows.size !== 1) throw new FedlangError("Expected fields with as many rows each, found " +
    JSON.stringify(Object.fromEntries(names.map((n) => [n, fields[n].shape[0]]))) + ".");
  const [n] = rows;
  const out = [];
  for (let start = 0; start < n; start += batchSize) {
    const stop = Math.min(n, start + batchSize);
    const batch = {};
    for (const name of names) {
      const { data, shape } = fields[name];
      const row = size(shape.slice(1));
      batch[name] = { data: data.subarray(start * row, stop * row), shape: [stop - start, ...shape.slice(1)] };
    }
    out.push(batch);
  }
  return out;
}

function leafOf(batch, path) {
  let v = batch;
  for (const key of path) {
    if (v === undefined || v === null) break;
    v = v[key];
  }
  if (!v || !v.data) {
    throw new FedlangError(`Expected each batch to hold a tensor {data, shape} at ${JSON.stringify(path)}, ` +
                           "found none.");
  }
  return v;
}

// ---------------------------------------------------------------------------
// Running a browser task

let ortReady = false;

function setUpOrt(base) {
  if (!ortReady) {
    ort.env.wasm.wasmPaths = new URL("ort/", base).href;
    ort.env.wasm.numThreads = 1;  // threads need cross-origin isolation; one is enough
    ortReady = true;
  }
}

// A task's ONNX sessions and description, made once per plan.
export class BrowserTask {
  static async create(description) {
    if (!description || description.format !== TASK_FORMAT || description.version !== TASK_VERSION) {
      throw new FedlangError(`Expected a plan with a browser task (${TASK_FORMAT} version ` +
        `${TASK_VERSION}), found ${description ? description.format + " " + description.version : "none"}; ` +
        "the driver adds one with deployment_context(..., browser=True).");
    }
    const task = new BrowserTask();
    task.description = description;
    task.sessions = {};
    for (const [name, model] of Object.entries(description.programs)) {
      task.sessions[name] = await ort.InferenceSession.create(fromBase64(model));
    }
    return task;
  }

  // Runs the task on the broadcast value and the page's datasets; returns the report. A
  // task with client state starts from `stateBytes` (the stored state in the binary
  // value format; null: the task's initial state) and leaves the new state, in the same
  // format, in `this.newState` (null when the task does not write it).
  async run(broadcastBytes, data, onStep = () => {}, stateBytes = null) {
    const d = this.description;
    const slots = new Map();
    this.newState = null;
    if (d.state) {
      const stored = readValue(stateBytes || fromBase64(d.state.initial));
      const fits = stored.length === d.state.inputs.length && stored.every((t, i) => {
        const want = d.slots[d.state.inputs[i]];
        return t.dtype === want.dtype && JSON.stringify(t.shape) === JSON.stringify(want.shape);
      });
      if (!fits) {
        throw new FedlangError(`Expected the stored client state "${d.state.name}" to match the ` +
          "task's state type, found another; it was written for another task (clear this " +
          "site's IndexedDB to start from the initial state).");
      }
      d.state.inputs.forEach((slot, i) => slots.set(slot, stored[i]));
    }
    const received = readValue(broadcastBytes);
    if (received.length !== d.broadcast.length) {
      throw new FedlangError(`Expected a broadcast of ${d.broadcast.length} tensors, found ${received.length}.`);
    }
    d.broadcast.forEach((slot, i) => {
      const want = d.slots[slot];
      if (received[i].dtype !== want.dtype) {
        throw new FedlangError(`Expected broadcast tensor ${i} of dtype ${want.dtype}, found ${received[i].dtype}.`);
      }
      slots.set(slot, received[i]);
    });
    for (const [slot, c] of Object.entries(d.consts)) {
      slots.set(Number(slot), tensor(c.dtype, c.shape, new ARRAYS[c.dtype](fromBase64(c.data).buffer)));
    }
    for (const step of d.run) {
      if (step.kind === "run") {
        await this.call(step, slots, {});
        continue;
      }
      const dataset = data[step.dataset];
      if (!dataset) {
        throw new FedlangError(`The task reads client data "${step.dataset}", but this page has ` +
                               `${JSON.stringify(Object.keys(data))}.`);
      }
      const leaves = d.data[step.dataset].leaves;
      let done = 0;
      for await (const batch of dataset) {  // arrays, or async iterables streaming batches
        const extra = {};
        let rows = 1;
        Object.entries(step.batch).forEach(([name, path], i) => {
          const leaf = leafOf(batch, path);
          const dtype = leaves[i].dtype;
          const shape = leaf.shape || leaf.dims;
          extra[name] = tensor(dtype, shape, convert(leaf.data, dtype));
          if (shape.length) rows = shape[0];
        });
        extra[step.mask] = tensor("float32", [rows], new Float32Array(rows).fill(1));
        await this.call(step, slots, extra);
        done += 1;
        onStep({ dataset: step.dataset, batches: done });
      }
    }
    if (d.state && d.state.outputs.length) {
      this.newState = writeValue(d.state.header, d.state.outputs.map((slot) => slots.get(slot)));
    }
    return this.report(slots);
  }

  async call(step, slots, extra) {
    const session = this.sessions[step.program];
    const feeds = {};
    for (const name of session.inputNames) {
      const t = name in extra ? extra[name] : slots.get(step.inputs[name]);
      if (!t) throw new FedlangError(`Expected a value for input ${name} of ${step.program}, found none.`);
      feeds[name] = new ort.Tensor(t.dtype, t.data, t.shape);
    }
    const names = Object.keys(step.outputs);
    const results = await session.run(feeds, names);
    for (const name of names) {
      const r = results[name];
      const slot = step.outputs[name];
      slots.set(slot, tensor(this.description.slots[slot].dtype, r.dims, r.data));
    }
  }

  // The report: each tensor from its recipe, in the header's dtype (as run_plan_parts):
  // the model's dtype for a sum's total (float32 for a float32 model), not a wider one.
  report(slots) {
    const { header, leaves } = this.description.report;
    const dtypes = [];
    const walk = (v) => {
      if (Array.isArray(v)) v.forEach(walk);
      else if (v && typeof v === "object" && "blob" in v) dtypes.push(v.dtype);
    };
    walk(header.value);
    const out = leaves.map((recipe, i) => {
      const dtype = dtypes[i];
      if ("value" in recipe) return tensor(dtype, [], convert([recipe.value], dtype));
      const x = slots.get(recipe.slot);
      if ("times" in recipe) {
        const w = Number(slots.get(recipe.times).data[0]);
        return tensor(dtype, x.shape, convert(Array.from(x.data, (v) => Math.fround(v * w)), dtype));
      }
      return tensor(dtype, x.shape, convert(x.data, dtype));
    });
    return writeValue(header, out);
  }
}

// ---------------------------------------------------------------------------
// Client states, kept in IndexedDB

// One record per population and state name: the state's bytes in the binary value
// format. A put is one IndexedDB transaction (all or nothing), made once the server
// acknowledged the report computed with the state.
export class StateStore {
  constructor(name = "fedlang-client-state") {
    this.name = name;
    this.db = null;
  }

  async open() {
    if (!this.db) {
      this.db = await new Promise((resolve, reject) => {
        const request = indexedDB.open(this.name, 1);
        request.onupgradeneeded = () => request.result.createObjectStore("states");
        request.onsuccess = () => resolve(request.result);
        request.onerror = () => reject(new FedlangError(
          `Expected to open the IndexedDB database "${this.name}" for client state, found ` +
          `${request.error}; allow this site to store data.`));
      });
    }
    return this.db;
  }

  async get(key) {
    const db = await this.open();
    return new Promise((resolve, reject) => {
      const request = db.transaction("states", "readonly").objectStore("states").get(key);
      request.onsuccess = () => resolve(request.result ? new Uint8Array(request.result) : null);
      request.onerror = () => reject(request.error);
    });
  }

  async put(key, bytes) {
    const db = await this.open();
    return new Promise((resolve, reject) => {
      const tx = db.transaction("states", "readwrite", { durability: "strict" });
      tx.objectStore("states").put(bytes, key);
      tx.oncomplete = () => resolve();
      tx.onerror = () => reject(tx.error);
      tx.onabort = () => reject(tx.error);
    });
  }
}

// ---------------------------------------------------------------------------
// The client

function sleep(seconds, signal) {
  return new Promise((resolve) => {
    const timer = setTimeout(resolve, seconds * 1000);
    if (signal) signal.addEventListener("abort", () => { clearTimeout(timer); resolve(); }, { once: true });
  });
}

const RETRY_STATUS = new Set([429, 502, 503, 504]);
const MiB = 2 ** 20;
// The largest blob a page downloads unless told otherwise: the page holds a blob as one
// ArrayBuffer and ONNX Runtime makes its own copy of the weights, so a 1 GiB model already
// takes over 2 GiB of a tab, near what browsers let one tab hold.
const MAX_BLOB_BYTES = 1024 * MiB;
// The blobs a client keeps, as the Python client: a plan and a broadcast per round, a few
// rounds of small ones; a blob larger than KEPT_BLOB_BYTES is kept alone (the one in use).
const KEPT_BLOBS = 8;
const KEPT_BLOB_BYTES = 64 * MiB;
// A download tells its progress each 5% of its length or each 8 MiB, whichever is fewer bytes.
const PROGRESS_FRACTION = 0.05;
const PROGRESS_BYTES = 8 * MiB;

function byteSize(n) {
  return n >= MiB ? `${(n / MiB).toFixed(1)} MiB (${n} bytes)` : `${n} bytes`;
}

export class FedlangClient {
  // server: the task store's URL (default: this page's origin); population, token: the
  // population and its enrollment token; data: {name: array of batches}; publicKey: the
  // server's key (base64) if pinned in advance; credential: {client_id, credential,
  // public_key} from an earlier enrollment; onEvent: called with progress events;
  // stateDatabase: the IndexedDB database keeping this client's client states;
  // maxBlobBytes: the largest plan or broadcast (the model's weights) it downloads.
  constructor({ server = location.origin, population, token = null, data = {}, publicKey = null,
                credential = null, onEvent = () => {}, backoff = [0.2, 10], patience = 300,
                stateDatabase = "fedlang-client-state", maxBlobBytes = MAX_BLOB_BYTES } = {}) {
    if (!(Number.isSafeInteger(maxBlobBytes) && maxBlobBytes > 0)) {
      throw new FedlangError(`Expected maxBlobBytes a positive whole number of bytes, found ${maxBlobBytes}.`);
    }
    this.server = server.replace(/\/$/, "");
    this.population = population;
    this.token = token;
    this.data = data;
    this.pinned = publicKey ? fromBase64(publicKey) : null;
    this.onEvent = onEvent;
    this.backoff = backoff;
    this.patience = patience;
    this.maxBlobBytes = maxBlobBytes;
    this.credential = null;
    this.clientId = null;
    this.tasksDone = 0;
    this.lastReport = null;
    this.lastTask = null;
    this.blobs = new Map();
    this.tasks = new Map();
    this.stopper = new AbortController();
    this.states = new StateStore(stateDatabase);
    if (credential) {
      this.pin(fromBase64(credential.public_key));
      this.clientId = credential.client_id;
      this.credential = credential.credential;
    }
    setUpOrt(new URL("./", import.meta.url));
  }

  emit(type, fields = {}) {
    try { this.onEvent({ type, ...fields }); } catch (e) { console.error(e); }
  }

  pin(key) {
    if (this.pinned && hex(key) !== hex(this.pinned)) {
      throw new FedlangError(`Expected the server's public key ${toBase64(this.pinned)} (pinned), ` +
                             `found ${toBase64(key)}; this is not the server this page enrolled with.`);
    }
    this.pinned = key;
  }

  stop() { this.stopper.abort(); }

  get stopped() { return this.stopper.signal.aborted; }

  // fetch with retries (connection errors, 502/503/504) and backoff with full jitter, and
  // 429 (rate limited) after the seconds its Retry-After says; returns a 2xx response or
  // throws a FedlangError carrying the 4xx/5xx status.
  async request(method, path, { token = null, body = null, headers = {} } = {}) {
    const started = Date.now();
    for (let attempt = 0; ; attempt++) {
      let problem, told = null;
      try {
        const h = { ...headers };
        if (token) h.Authorization = `Bearer ${token}`;
        const response = await fetch(this.server + path, { method, headers: h, body, cache: "no-store" });
        if (response.ok) return response;
        if (!RETRY_STATUS.has(response.status)) {
          let detail = response.statusText, reason = "";
          try { ({ detail, reason } = await response.json()); } catch (e) { /* not JSON */ }
          throw new FedlangError(String(detail), response.status, reason || "");
        }
        problem = `HTTP ${response.status}`;
        const after = Number(response.headers.get("Retry-After"));
        if (response.headers.has("Retry-After") && after >= 0 && after < 86400) told = after;
      } catch (e) {
        if (e instanceof FedlangError) throw e;
        problem = String(e);  // the server is unreachable (restarting?)
      }
      const waited = (Date.now() - started) / 1000;
      if (waited > this.patience || this.stopped) {
        throw new FedlangError(`Expected the server at ${this.server} to answer ${method} ${path}, ` +
                               `found ${problem} for ${Math.round(waited)} s.`);
      }
      const [first, largest] = this.backoff;
      const wait = told !== null ? told + Math.random() * Math.min(told, 1) / 4
        : Math.random() * Math.min(largest, first * 2 ** attempt);
      this.emit("retry", { problem, wait });
      await sleep(wait, this.stopper.signal);
    }
  }

  async enroll() {
    if (!this.token) {
      throw new FedlangError(`Expected an enrollment token for population "${this.population}", found none.`);
    }
    const answer = await (await this.request("POST", `${API}/populations/${this.population}/enroll`,
                                             { token: this.token })).json();
    this.pin(fromBase64(answer.public_key));
    this.clientId = answer.client_id;
    this.credential = answer.credential;
    this.emit("enrolled", { clientId: answer.client_id, credential: answer });
    return answer.client_id;
  }

  // A request with the credential; enrolls (again) when it is missing or refused.
  async authorized(method, path, options = {}) {
    if (!this.credential) await this.enroll();
    try {
      return await this.request(method, path, { ...options, token: this.credential });
    } catch (e) {
      if (!(e instanceof FedlangError) || e.status !== 401 || !this.token) throw e;
      await this.enroll();
      return this.request(method, path, { ...options, token: this.credential });
    }
  }

  async blob(hash) {
    if (!this.blobs.has(hash)) {
      const bytes = await this.download(hash);
      if (hex(await sha256(bytes)) !== hash) {
        throw new FedlangError(`Expected blob ${hash} from the server, found bytes with another hash.`);
      }
      this.blobs.set(hash, bytes);
      const kept = () => [...this.blobs.values()].reduce((n, b) => n + b.length, 0);
      while (this.blobs.size > 1 && (this.blobs.size > KEPT_BLOBS || kept() > KEPT_BLOB_BYTES)) {
        this.blobs.delete(this.blobs.keys().next().value);  // the oldest; the new one stays
      }
    }
    return this.blobs.get(hash);
  }

  // Blob `hash`'s bytes, read chunk by chunk into one buffer of the announced length
  // (arrayBuffer() can hold a body twice). A blob over maxBlobBytes is refused before its
  // body is read when the server says its length, or as soon as it passes the limit.
  async download(hash) {
    const response = await this.authorized("GET", `${API}/blobs/${hash}`);
    const length = response.headers.get("Content-Length");
    const total = length === null ? null : Number(length);
    if (total !== null && total > this.maxBlobBytes) {
      await response.body?.cancel().catch(() => {});
      throw this.tooLarge(hash, byteSize(total));
    }
    let bytes = new Uint8Array(total ?? Math.min(MiB, this.maxBlobBytes));
    let received = 0, told = -1;
    const every = total ? Math.min(PROGRESS_BYTES, total * PROGRESS_FRACTION) : PROGRESS_BYTES;
    const reader = response.body?.getReader();
    for (;;) {
      const { done, value } = reader ? await reader.read() : { done: true };
      if (done) break;
      const end = received + value.length;
      if (end > this.maxBlobBytes) {
        await reader.cancel().catch(() => {});
        throw this.tooLarge(hash, `more than ${byteSize(this.maxBlobBytes)}`);
      }
      if (end > bytes.length) {  // no length given (or a compressed one): grow
        const grown = new Uint8Array(Math.min(this.maxBlobBytes, Math.max(2 * bytes.length, end)));
        grown.set(bytes.subarray(0, received));
        bytes = grown;
      }
      bytes.set(value, received);
      received = end;
      if (received - Math.max(told, 0) >= every) {
        told = received;
        this.emit("download", { hash, received, total });
      }
    }
    if (told !== received) this.emit("download", { hash, received, total });
    return received === bytes.length ? bytes : bytes.subarray(0, received);
  }

  tooLarge(hash, found) {
    return new FedlangError(
      `Expected blob ${hash} within maxBlobBytes, this client's limit of ` +
      `${byteSize(this.maxBlobBytes)}, found ${found}; pass a larger maxBlobBytes to ` +
      "FedlangClient if this browser has the memory, or use the Python client " +
      "(fedlang.deploy.Client) for models this large.", 0, "too_large");
  }

  // The verified plan's browser task (kept: rounds of one computation share a plan).
  async task(hash) {
    if (!this.tasks.has(hash)) {
      const payload = await verifySigned(await this.blob(hash), this.pinned);
      const plan = JSON.parse(new TextDecoder().decode(payload));
      this.tasks.clear();
      this.tasks.set(hash, await BrowserTask.create(plan.browser));
    }
    return this.tasks.get(hash);
  }

  // Checks in and runs tasks until the population is finished, `maxTasks` reports were
  // accepted or `stop()` is called; returns the number of tasks done.
  async run({ maxTasks = Infinity } = {}) {
    while (!this.stopped && this.tasksDone < maxTasks) {
      const answer = await (await this.authorized("POST", `${API}/checkin`)).json();
      if (answer.finished) {
        this.emit("finished");
        break;
      }
      if (!answer.task) {
        this.emit("wait", { seconds: answer.retry_after });
        await sleep(answer.retry_after || 1, this.stopper.signal);
        continue;
      }
      await this.runTask(answer.task);
    }
    return this.tasksDone;
  }

  // The task is the one the server signed: its ticket, verified with the pinned key,
  // names the same round (or session), kind, plan, broadcast (the model's weights) and
  // version.
  async checkTicket(task) {
    const signed = JSON.parse(new TextDecoder().decode(
      await verifySigned(fromBase64(task.ticket || ""), this.pinned)));
    for (const field of ["round", "session", "kind", "plan", "broadcast", "version"]) {
      if ((signed[field] ?? null) !== (task[field] ?? null)) {
        throw new FedlangError(`Expected the task the server signed, found another ${field} ` +
          `(${task[field]} where the server signed ${signed[field]}); someone between this ` +
          "page and the server changed it.");
      }
    }
  }

  async runTask(task) {
    this.emit("task", { round: task.round, secondsLeft: task.seconds_left });
    await this.checkTicket(task);
    const started = performance.now();
    const browserTask = await this.task(task.plan);
    const broadcast = await this.blob(task.broadcast);
    const kept = browserTask.description.state;
    const stateKey = kept ? `${this.population}/${kept.name}` : null;
    const stored = kept ? await this.states.get(stateKey) : null;
    const report = await browserTask.run(broadcast, this.data,
      (progress) => this.emit("step", { round: task.round, ...progress }), stored);
    const newState = browserTask.newState;
    this.lastTask = task;
    this.lastReport = report;
    try {
      await this.authorized("PUT", `${API}/rounds/${task.round}/report`, {
        body: report, headers: { "Content-Type": "application/octet-stream", ...taskHeader(task) },
      });
    } catch (e) {
      if (e instanceof FedlangError && [403, 409, 410].includes(e.status)) {
        this.emit("refused", { round: task.round, status: e.status, reason: e.reason, detail: e.message });
        return false;
      }
      throw e;
    }
    if (newState) {  // the server holds the report: keep the state it was computed with
      await this.states.put(stateKey, newState);
      this.emit("state", { round: task.round, name: kept.name, bytes: newState.length });
    }
    this.tasksDone += 1;
    this.emit("report", { round: task.round, bytes: report.length, report, plan: task.plan,
                          broadcast: task.broadcast, tasksDone: this.tasksDone,
                          seconds: (performance.now() - started) / 1000 });
    return true;
  }
}

export { ort };
