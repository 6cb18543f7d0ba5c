'use strict';

// Runs a decentralized COINSTAC computation with COINSTAC's own pipeline code, the way
// coinstac-simulator 6.9.8 does (src/index.js): an MQTT broker (aedes), one remote and one
// local pipeline manager per site (coinstac-pipeline), containers through
// coinstac-container-manager's "singularity" service. The "singularity" on PATH is the test's
// stand-in that starts the computation as a process; no Docker daemon is involved.
//
// usage: node run.js job.json
//   job: compspec, inputspec, directory (the simulator folder), imageDirectory, timeoutSeconds,
//        result (where {ok, seconds, iterations, remote, locals, error} is written), logLevel

const fs = require('fs');
const net = require('net');
const path = require('path');

// Every server started here (the broker, the remote's file server) listens on loopback only:
// coinstac-pipeline's express server calls listen(port) on every interface.
const listen = net.Server.prototype.listen;
net.Server.prototype.listen = function loopbackOnly(...args) {
  if (typeof args[0] === 'number' && typeof args[1] !== 'string') args.splice(1, 0, '127.0.0.1');
  else if (args[0] && typeof args[0] === 'object' && 'port' in args[0]) args[0] = { ...args[0], host: '127.0.0.1' };
  return listen.apply(this, args);
};
// coinstac-pipeline's shared-volume mode: the state's directories are host paths, which is what a
// container with the simulator's bind mounts sees as well.
process.env.CI = '1';

const job = JSON.parse(fs.readFileSync(process.argv[2], 'utf8'));
process.LOGLEVEL = job.logLevel || 'info'; // read by coinstac-pipeline's logger when it is loaded
const Pipeline = require('coinstac-pipeline');
const aedes = require('aedes');

const RUN_ID = 'simulatorRun';

function freePort() {
  return new Promise((resolve, reject) => {
    const s = net.createServer();
    s.on('error', reject);
    s.listen(0, '127.0.0.1', () => {
      const { port } = s.address();
      s.close(() => resolve(port));
    });
  });
}

function startBroker() {
  const broker = aedes();
  const server = net.createServer(broker.handle);
  return new Promise((resolve, reject) => {
    server.on('error', reject);
    server.listen(0, '127.0.0.1', () => resolve({ broker, server, port: server.address().port }));
  });
}

// as coinstac-simulator's pipelineSpecFactory: one step, the site's inputspec entry as its input map
function pipelineSpec(inputMap, compspec) {
  return { steps: [{ inputMap, controller: { type: 'decentralized' }, computations: [compspec] }] };
}

async function main() {
  const started = Date.now();
  const compspec = JSON.parse(fs.readFileSync(job.compspec, 'utf8'));
  const inputspec = JSON.parse(fs.readFileSync(job.inputspec, 'utf8'));
  const operatingDirectory = path.resolve(job.directory);
  const { broker, server, port: mqttPort } = await startBroker();
  const remotePort = await freePort();
  const common = {
    operatingDirectory,
    imageDirectory: path.resolve(job.imageDirectory),
    remotePort,
    remoteURL: '127.0.0.1',
    mqttRemoteURL: '127.0.0.1',
    mqttRemotePort: mqttPort,
    mqttRemoteProtocol: 'mqtt:',
  };
  const clients = inputspec.map((_, i) => `local${i}`);
  let iterations = 0;

  const remote = await Pipeline.create({ ...common, clientId: 'remote', mode: 'remote' });
  remote.containerManager.setServiceProvider('singularity');
  const remoteRun = remote.startPipeline({
    spec: pipelineSpec(inputspec[0], compspec),
    runId: RUN_ID,
    clients: Object.fromEntries(clients.map(c => [c, c])),
  });
  remoteRun.stateEmitter.on('update', (s) => {
    if (Number.isFinite(s.currentIteration)) iterations = Math.max(iterations, s.currentIteration);
  });
  const localRuns = [];
  for (let i = 0; i < clients.length; i += 1) {
    const manager = await Pipeline.create({ ...common, clientId: clients[i], mode: 'local' }); // eslint-disable-line no-await-in-loop
    localRuns.push(manager.startPipeline({ spec: pipelineSpec(inputspec[i], compspec), runId: RUN_ID }));
  }

  const timeout = new Promise((_, reject) => {
    setTimeout(() => reject(new Error(`the run did not finish within ${job.timeoutSeconds} s`)),
      job.timeoutSeconds * 1000).unref();
  });
  const result = { ok: false, iterations: 0, remote: null, locals: [], error: null };
  try {
    const [remoteOut, ...localOuts] = await Promise.race([
      Promise.all([remoteRun.result, ...localRuns.map(r => r.result)]),
      timeout,
    ]);
    Object.assign(result, { ok: true, remote: remoteOut, locals: localOuts });
  } catch (e) {
    result.error = (e && (e.stack || e.message)) || String(e);
  }
  result.iterations = iterations;
  result.seconds = (Date.now() - started) / 1000;
  fs.writeFileSync(job.result, JSON.stringify(result));
  server.close();
  broker.close();
  // the pipeline managers keep MQTT clients and the file server open; the run is over
  process.exit(result.ok ? 0 : 1);
}

main().catch((e) => {
  fs.writeFileSync(job.result, JSON.stringify({ ok: false, error: e.stack || String(e) }));
  process.exit(1);
});
