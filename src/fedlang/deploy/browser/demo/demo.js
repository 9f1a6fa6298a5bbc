// The demo page: pick an .npz file, join the population, train, show progress.
import { FedlangClient, batches, readStructured } from "/browser/fedlang.js";
import { readNpz } from "/browser/npz.js";

const $ = (id) => document.getElementById(id);
const params = new URLSearchParams(location.hash.slice(1) || location.search.slice(1));
$("population").value = params.get("population") || "";
$("token").value = params.get("token") || "";
let client = null;

function log(text) {
  const line = `${new Date().toLocaleTimeString()}  ${text}\n`;
  $("log").textContent = line + $("log").textContent;
}

// The client's own training metrics in its report, where the task is one of
// fedlang.learning's: its statistics are sums (`loss_sum`, `num_examples`, and per metric
// a sum and a `count`, as Accuracy's `correct`/`count`), which the server adds over the
// cohort before dividing. Divided here, they are this client's loss and metrics over the
// examples it trained on in this round. Null when the report holds no such statistics.
export function trainingMetrics(report) {
  const scalar = (t) => (t && t.data && t.data.length === 1 ? Number(t.data[0]) : null);
  const find = (v) => {
    if (!v || typeof v !== "object" || v.data) return null;
    if ("loss_sum" in v && "num_examples" in v) return v;
    for (const x of Object.values(v)) {
      const found = find(x);
      if (found) return found;
    }
    return null;
  };
  const stats = find(readStructured(report));
  if (!stats) return null;
  const examples = scalar(stats.num_examples);
  const out = { examples, loss: scalar(stats.loss_sum) / Math.max(examples, 1) };
  for (const [name, m] of Object.entries(stats.metrics || {})) {
    const parts = Object.entries(m || {}).filter(([k]) => k !== "count");
    if (m && m.count && parts.length === 1) out[name] = scalar(parts[0][1]) / Math.max(scalar(m.count), 1);
  }
  return out;
}

function show(event, totalBatches) {
  switch (event.type) {
    case "enrolled": log(`enrolled as ${event.clientId}`); break;
    case "wait": $("status").textContent = `Waiting for a task (next check-in in ${event.seconds.toFixed(1)} s).`; break;
    case "task":
      $("round").textContent = event.round;
      $("status").textContent = `Training for round ${event.round}...`;
      $("progress").value = 0;
      log(`round ${event.round}: task received`);
      break;
    case "step": $("progress").value = event.batches / totalBatches; break;
    case "report": {
      $("reports").textContent = event.tasksDone;
      $("status").textContent = `Round ${event.round} reported (${event.seconds.toFixed(2)} s).`;
      const metrics = trainingMetrics(event.report);
      let shown = "";
      if (metrics) {
        $("loss").textContent = metrics.loss.toFixed(4);
        $("accuracy").textContent = "accuracy" in metrics ? metrics.accuracy.toFixed(4) : "-";
        shown = Object.entries(metrics).filter(([k]) => k !== "examples")
          .map(([k, v]) => `${k} ${v.toFixed(4)}`).join(", ") + ` on ${metrics.examples} examples; `;
      }
      log(`round ${event.round}: report accepted (${shown}${event.bytes} bytes, ${event.seconds.toFixed(2)} s)`);
      break;
    }
    case "refused": log(`round ${event.round}: report refused (${event.reason}): ${event.detail}`); break;
    case "retry": $("status").textContent = `Server unreachable (${event.problem}); retrying...`; break;
    case "finished": log("the population is finished"); break;
  }
}

$("form").addEventListener("submit", async (e) => {
  e.preventDefault();
  const arrays = await readNpz(new Uint8Array(await $("file").files[0].arrayBuffer()));
  const data = batches(arrays, Number($("batch").value));
  const examples = Object.values(arrays)[0].shape[0];
  $("examples").textContent = examples;
  log(`loaded ${Object.keys(arrays).join(", ")}: ${examples} examples in ${data.length} batches`);
  client = new FedlangClient({
    population: $("population").value, token: $("token").value, data: { [$("dataset").value]: data },
    onEvent: (event) => show(event, data.length),
  });
  window.fedlangClient = client;
  $("start").disabled = true;
  $("stop").disabled = false;
  try {
    const done = await client.run();
    $("status").textContent = `Done: ${done} rounds reported.`;
  } catch (error) {
    $("status").textContent = `Stopped: ${error.message}`;
    log(`error: ${error.message}`);
  }
  $("start").disabled = false;
  $("stop").disabled = true;
});

$("stop").addEventListener("click", () => client && client.stop());
