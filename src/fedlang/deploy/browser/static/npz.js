// npz.js: reads NumPy's .npz files (np.savez, np.savez_compressed) in the browser, so a
// page can train on a file the user picks. Returns {name: {dtype, shape, data}}.

const DTYPES = {
  "<f4": ["float32", Float32Array], "<f8": ["float64", Float64Array],
  "<i4": ["int32", Int32Array], "<i8": ["int64", BigInt64Array],
  "|i1": ["int8", Int8Array], "|u1": ["uint8", Uint8Array], "|b1": ["bool", Uint8Array],
};

async function inflate(bytes) {
  const stream = new Blob([bytes]).stream().pipeThrough(new DecompressionStream("deflate-raw"));
  return new Uint8Array(await new Response(stream).arrayBuffer());
}

// The files of a zip archive: {name: bytes}, read through its central directory (zip64
// included: np.savez writes zip64 entries).
async function unzip(bytes) {
  const view = new DataView(bytes.buffer, bytes.byteOffset, bytes.byteLength);
  let end = -1;
  for (let i = bytes.length - 22; i >= Math.max(0, bytes.length - 65557); i--) {
    if (view.getUint32(i, true) === 0x06054b50) { end = i; break; }
  }
  if (end < 0) throw new Error("Expected a .npz file (a zip archive), found another kind of file.");
  let entries = view.getUint16(end + 10, true);
  let offset = view.getUint32(end + 16, true);
  if (offset === 0xffffffff && view.getUint32(end - 20, true) === 0x07064b50) {
    const record = Number(view.getBigUint64(end - 12, true));
    entries = Number(view.getBigUint64(record + 32, true));
    offset = Number(view.getBigUint64(record + 48, true));
  }
  const files = {};
  for (let e = 0; e < entries; e++) {
    if (view.getUint32(offset, true) !== 0x02014b50) throw new Error("Expected a zip central directory entry.");
    const method = view.getUint16(offset + 10, true);
    let compressed = view.getUint32(offset + 20, true);
    let uncompressed = view.getUint32(offset + 24, true);
    const nameLen = view.getUint16(offset + 28, true);
    const extraLen = view.getUint16(offset + 30, true);
    const commentLen = view.getUint16(offset + 32, true);
    let local = view.getUint32(offset + 42, true);
    const name = new TextDecoder().decode(bytes.subarray(offset + 46, offset + 46 + nameLen));
    for (let p = offset + 46 + nameLen; p < offset + 46 + nameLen + extraLen;) {
      const id = view.getUint16(p, true), len = view.getUint16(p + 2, true);
      if (id === 0x0001) {  // zip64: the 64-bit values of the fields that overflowed
        let q = p + 4;
        if (uncompressed === 0xffffffff) { uncompressed = Number(view.getBigUint64(q, true)); q += 8; }
        if (compressed === 0xffffffff) { compressed = Number(view.getBigUint64(q, true)); q += 8; }
        if (local === 0xffffffff) { local = Number(view.getBigUint64(q, true)); }
      }
      p += 4 + len;
    }
    const start = local + 30 + view.getUint16(local + 26, true) + view.getUint16(local + 28, true);
    const raw = bytes.subarray(start, start + compressed);
    if (method === 0) files[name] = raw.slice();
    else if (method === 8) files[name] = await inflate(raw);
    else throw new Error(`Expected stored or deflated entries in the .npz file, found method ${method}.`);
    offset += 46 + nameLen + extraLen + commentLen;
  }
  return files;
}

// One .npy array: {dtype, shape, data}.
export function readNpy(bytes) {
  const view = new DataView(bytes.buffer, bytes.byteOffset, bytes.byteLength);
  if (bytes[0] !== 0x93 || new TextDecoder().decode(bytes.subarray(1, 6)) !== "NUMPY") {
    throw new Error("Expected a .npy array, found another kind of data.");
  }
  const major = bytes[6];
  const headerLen = major === 1 ? view.getUint16(8, true) : view.getUint32(8, true);
  const start = major === 1 ? 10 : 12;
  const header = new TextDecoder().decode(bytes.subarray(start, start + headerLen));
  const descr = /'descr':\s*'([^']+)'/.exec(header)[1];
  if (/'fortran_order':\s*True/.test(header)) throw new Error("Expected C-ordered arrays, found Fortran order.");
  const shape = /'shape':\s*\(([^)]*)\)/.exec(header)[1].split(",").filter((s) => s.trim()).map(Number);
  if (!(descr in DTYPES)) throw new Error(`Expected arrays of ${Object.keys(DTYPES)}, found ${descr}.`);
  const [dtype, Array_] = DTYPES[descr];
  const data = new Array_(bytes.slice(start + headerLen).buffer);
  return { dtype, shape, data };
}

// The arrays of a .npz file (bytes), by name.
export async function readNpz(bytes) {
  const out = {};
  for (const [name, data] of Object.entries(await unzip(bytes))) {
    out[name.replace(/\.npy$/, "")] = readNpy(data);
  }
  return out;
}
