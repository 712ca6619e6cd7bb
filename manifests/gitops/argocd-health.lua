-- Argo CD health of an InferencePolicy (argocd-cm:
-- resource.customizations.health.kinference.io_InferencePolicy). It reads
-- the same conditions as kstatus: Stalled (the policy must change) is
-- Degraded, Ready is Healthy, anything else (the operator has not seen this
-- generation, the EPP is rolling out or loading the policy) is Progressing.
local hs = { status = "Progressing", message = "Waiting for the operator" }
if obj.status == nil or obj.status.conditions == nil then
  return hs
end
if obj.metadata.generation ~= nil and obj.status.observedGeneration ~= obj.metadata.generation then
  hs.message = "Waiting for the operator to observe generation " .. obj.metadata.generation
  return hs
end
for _, c in ipairs(obj.status.conditions) do
  if c.type == "Stalled" and c.status == "True" then
    hs.status = "Degraded"
    hs.message = c.message
    return hs
  end
end
for _, c in ipairs(obj.status.conditions) do
  if c.type == "Ready" then
    if c.status == "True" then
      hs.status = "Healthy"
    end
    hs.message = c.message
  end
end
return hs
