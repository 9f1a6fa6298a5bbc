// The demo page: pick an .npz file, join the population, train, show progress.
import { FedlangClient, batches } from "/browser/fedlang.js";
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
    case "report":
      $("reports").textContent = event.tasksDone;
      $("status").textContent = `Round ${event.round} reported (${event.seconds.toFixed(2)} s).`;
      log(`round ${event.round}: report accepted (${event.bytes} bytes, ${event.seconds.toFixed(2)} s)`);
      break;
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
